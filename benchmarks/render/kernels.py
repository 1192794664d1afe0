"""Kernels and profiles: linear and output-head kernels, the decode profile, drafter kernels, SpecBlock's gradient terms."""

from __future__ import annotations

from benchmarks.render.base import fmt, renderer


@renderer("linear_kernels")
def render_linear_kernels(res: dict) -> list[str]:
    """Vanilla and retrieval under each linear-kernel arm, interleaved prompt by prompt."""
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, {res['prompts']} Spec-Bench first turns, "
             f"{res['max_new_tokens']} new tokens, greedy; every arm on the same model object, prompt by prompt.", "",
             "| kernels | method | tok/s | vs linear vanilla | tokens identical to linear vanilla | head ms, M = 1 | head ms, M = 8 |",
             "|---|---|---|---|---|---|---|"]
    for arm, per in res["tokens_per_s"].items():
        for method, rate in per.items():
            h = res["head_product_s"][arm]
            lines.append(f"| {arm} | {method} | {fmt(rate, 1)} | {fmt(res['speedup_vs_linear_vanilla'][arm][method], 2, '×')} | "
                         f"{fmt(res['identical_to_linear_vanilla'][arm][method])} | {fmt(h['M=1'] * 1000, 2)} | "
                         f"{fmt(h['M=8'] * 1000, 2)} |")
    return lines


@renderer("decode_profile")
def render_decode_profile(res: dict) -> list[str]:
    """A vanilla decode step: wall time, and the profiler's operator self-times grouped."""
    g = res["groups_ms_per_step"]
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, {res['steps']} greedy decode steps after a "
             f"{res['prompt_tokens']}-token prompt. Wall per step without the profiler: "
             f"**{fmt(res['wall_ms_per_step'], 1)} ms** (median of {len(res.get('walls_ms', [])) or 3} runs); under the profiler "
             f"{fmt(res['profiled_wall_ms_per_step'], 1)} ms.", ""]
    if res.get("lean_forward") is not None:
        lines += [f"Target forward: {'the lean decoder loop' if res['lean_forward'] else 'transformers'} "
                  "(`speculation/model/lean_forward.py`).", ""]
    if res.get("baseline"):
        b = res["baseline"]
        name = b.get("name", "unfused")
        what = ("without grouped projections and fused norms (separate projections, linear layers packed)"
                if name == "unfused" else f"baseline `{name}` ({b['what']})")
        lines += [f"Side by side, run by run: {what} {fmt(b['wall_ms_per_step'], 1)} ms per step (median). "
                  f"The target, each run against its neighbour: **{fmt(b.get('paired_speedup_median'), 3)}×** "
                  f"as fast (median), faster in {b.get('pairs_faster', '–')} of {b.get('pairs', '–')} pairs; "
                  f"identical tokens: {fmt(b['identical_tokens'])}.", ""]
    lines += ["| part of the profiled step | ms per step | share |", "|---|---|---|"]
    wall = res["profiled_wall_ms_per_step"]
    for name in ("linear", "attention", "other operators"):
        lines.append(f"| {name} (operator self time) | {fmt(g.get(name, 0.0), 2)} | {fmt(100 * g.get(name, 0.0) / wall, 0, '%')} |")
    lines.append(f"| no operator (Python, module calls, profiler) | {fmt(res['unaccounted_ms_per_step'], 2)} | "
                 f"{fmt(100 * res['unaccounted_ms_per_step'] / wall, 0, '%')} |")
    lines += ["", "| operator | self ms per step | calls per step |", "|---|---|---|"]
    for op in res["top_operators"]:
        lines.append(f"| `{op['op']}` | {fmt(op['self_ms_per_step'], 3)} | {fmt(op['calls_per_step'], 1)} |")
    return lines


@renderer("drafter_kernels")
def render_drafter_kernels(res: dict) -> list[str]:
    """Feature drafters' networks, F.linear against packed layers, interleaved prompt by prompt."""
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, {res['prompts']} Spec-Bench first turns, "
             f"{res['max_new_tokens']} new tokens, greedy; both arms decode each prompt in turn.", "",
             "| drafter | network layers | drafting ms/step | verify ms/step | tok/s | tau |", "|---|---|---|---|---|---|"]
    for name, d in res["drafters"].items():
        for arm, a in d["arms"].items():
            what = f"oneDNN-packed ({d['packed_linear_layers']} layers)" if arm == "packed" else "`nn.Linear`"
            lines.append(f"| {name} | {what} | {fmt(a['drafting_ms_per_step'], 1)} | {fmt(a['verify_ms_per_step'], 1)} | "
                         f"{fmt(a['tokens_per_s'], 1)} | {fmt(a['tau'], 2)} |")
    lines.append("")
    for name, d in res["drafters"].items():
        lines.append(f"- {name}: drafting time, linear / packed per prompt: **{fmt(d['drafting_speedup_paired_median'], 2)}×** "
                     f"(median), packed faster on {d['prompts_faster']} of {res['prompts']} prompts; identical tokens: "
                     f"{fmt(d['identical_tokens'])}; lossless against vanilla: {fmt(d['lossless'])}.")
    profiled = {n: d["profile"] for n, d in res["drafters"].items() if "profile" in d}
    if profiled:
        lines += ["", "One drafter forward against its size: the bound is 1.5 × (drafter parameters / target parameters) "
                  "× one vanilla target decode step (#38).", "",
                  "| drafter | own parameters | share of target | target step ms | bound ms | forwards/step | "
                  "ms per forward, linear | packed | packed / bound |", "|---|---|---|---|---|---|---|---|---|"]
        for name, p in profiled.items():
            per = p["ms_per_forward"]
            lines.append(f"| {name} | {p['drafter_params'] / 1e6:.2f}M | {fmt(100 * p['share'], 1)}% | "
                         f"{fmt(p['target_step_ms'], 1)} | {fmt(p['bound_ms'], 2)} | {fmt(p['forwards_per_step']['packed'], 2)} | "
                         f"{fmt(per['linear'], 2)} | {fmt(per['packed'], 2)} | **{fmt(per['packed'] / p['bound_ms'], 2, '×')}** |")
    return lines


@renderer("output_head")
def render_output_head(res: dict) -> list[str]:
    """Vanilla decoding with each output head, interleaved prompt by prompt."""
    shape = res["head_shape"]
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, {res['prompts']} Spec-Bench first turns x "
             f"{res['repeats']} repeats, {res['max_new_tokens']} new tokens, greedy vanilla; head {shape[0]} x {shape[1]}.",
             "", "| head | tok/s | head product at M = 1, ms |", "|---|---|---|"]
    for name, rate in res["tokens_per_s"].items():
        lines.append(f"| {name} | {fmt(rate, 1)} | {fmt(res['head_product_s'][name] * 1000, 2)} |")
    lines += ["", f"Transposed / linear: **{fmt(res['ratio'], 3)}×**; identical tokens: {fmt(res['identical_tokens'])}."]
    return lines


@renderer("specblock_grad_terms")
def render_grad_terms(res: dict) -> list[str]:
    """Per-slot gradient norms of block 1's weighted slot losses, masked vs unmasked."""
    lines = [f"Checkpoint `{res['checkpoint']}`, {res['batches']} cached training batches.", "",
             "| mode | rows per slot (0..K-1) | gradient norm per slot term | global norm |", "|---|---|---|---|"]
    for mode, m in res["modes"].items():
        rows = " / ".join(fmt(r, 0) for r in m["slot_rows"])
        norms = " / ".join(fmt(g, 2) for g in m["slot_grad_norm"])
        lines.append(f"| {mode} | {rows} | {norms} | {fmt(m['total_grad_norm'], 2)} |")
    return lines
