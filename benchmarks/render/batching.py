"""Continuous batching: the closed loop per concurrency, goodput calibration, cost correction, folded prefills, A/B runs."""

from __future__ import annotations

from benchmarks.render.base import VERDICTS, fmt, ms, renderer, tau_cell, unavailable


def render_concurrency(res: dict) -> list[str]:
    """Closed-loop concurrency: per N and method, throughput, latency percentiles, tau, budget split."""
    saturated = any("saturated_tokens_per_s" in m for level in res["concurrency"].values()
                    for m in level["methods"].values())
    sat_head = "saturated tok/s | saturated speedup | saturated share | " if saturated else ""
    lines = ["", "Closed-loop clients over the batched engine (first turns; each client sends its next prompt "
             "when its request ends). Speedup is against batched vanilla at the same N; the HF peer is "
             "`generate` on left-padded static batches of N (not streamed, so no TTFT/ITL). vLLM peers run the "
             "same closed loop on vLLM's own engine loop (continuous batching, in `.venv-vllm`); their tau column "
             "is vLLM's mean acceptance length (AL), counted over drafted steps only.", "",
             f"| N | method | tok/s | speedup | {sat_head}request tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | tau | "
             "tree tokens / seq step | lossless |",
             "|---" * (13 if saturated else 10) + "|"]
    for n, level in res["concurrency"].items():
        rows = list(level["methods"].items()) + [(f"peer: {k}", v) for k, v in level.get("peers", {}).items()]
        for name, m in rows:
            sat = (f"{fmt(m.get('saturated_tokens_per_s'), 1)} | {fmt(m.get('saturated_speedup'), 2, '×')} | "
                   f"{fmt(m.get('saturated_share'), 2)} | " if saturated else "")
            lines.append(
                f"| {n} | {name} | {fmt(m['tokens_per_s'], 1)} | {fmt(m['speedup'], 2, '×')} | {sat}"
                f"{fmt(m['request_tokens_per_s'], 1)} | {ms(m['ttft_p50_s'])} / {ms(m['ttft_p99_s'])} | "
                f"{ms(m['itl_p50_s'])} / {ms(m['itl_p99_s'])} | {tau_cell(m)} | "
                f"{fmt(m.get('mean_tree_tokens_per_seq_step'), 1)} | {fmt(m.get('lossless'))} |")
    lines += unavailable(next((lv["peers_unavailable"] for lv in res["concurrency"].values()
                                if lv.get("peers_unavailable")), None))
    if saturated:
        lines += ["", "Saturated: the window from the start until the first client finds the dataset exhausted "
                      "(all N clients busy, the opening prefills included); share is its part of the run's wall "
                      "time. tok/s counts the drain too, where fewer than N requests are left."]
    ruled = [(n, name, m["goodput_verdicts"]) for n, level in res["concurrency"].items()
             for name, m in level["methods"].items() if m.get("goodput_verdicts")]
    if ruled:
        lines += ["", "The goodput rule's verdict before drafting, share of sequence steps (veto: the rule would "
                      "draft, but drafted steps had realised less than plain ones; retest: a vetoed step drafted "
                      "anyway to re-measure):", "", "| N | method | draft | probe | retest | skip | veto |",
                  "|---|---|---|---|---|---|---|"]
        for n, name, v in ruled:
            lines.append(f"| {n} | {name} | " + " | ".join(f"{100 * v[k]:.0f}%" for k in
                                                        VERDICTS) + " |")
    return lines


@renderer("goodput_calibration")
def render_goodput_calibration(res: dict) -> list[str]:
    """The goodput rule's steps against batched vanilla's on the same prompts (all-live steps only)."""
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, method `{res['method']}` with `goodput: true`, "
             f"{res['sequences']} Spec-Bench prompts together, {res['max_new_tokens']} new tokens each, greedy.", "",
             "| run | all-live steps | tokens | seconds | tok/s | steps drafted | steps probed | median step ms "
             "| median forward ms | median predicted forward ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in ("speculative", "vanilla"):
        t, m = res[f"{run}_total"], res[f"{run}_median"]
        pred = m.get("predicted_forward_s")
        lines.append(f"| {res['method'] if run == 'speculative' else 'batched vanilla'} | {t['steps']} | {t['tokens']} | "
                     f"{fmt(t['seconds'])} | {fmt(t['tokens_per_s'], 1)} | {t['steps_drafted']} | {t['steps_probed']} | "
                     f"{ms(m['step_s'])} | {ms(m['forward_s'])} | {ms(pred)} |")
    lines += ["", f"Median step seconds, vanilla / speculative: **{fmt(res['median_step_ratio'], 2)}**."]
    return lines


@renderer("cost_correction")
def render_cost_correction(res: dict) -> list[str]:
    """Solo retrieval on a clean c(T), on a disturbed one used as given, and on the disturbed one corrected online."""
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, {res['prompts']} Spec-Bench first turns, "
             f"{res['max_new_tokens']} new tokens, greedy, one request at a time, arms interleaved per prompt; "
             f"the disturbed curve was measured with {res['burners']} busy-loop processes on the cores.", "",
             "| arm | tok/s | speedup | tau | tree tokens | lossless |", "|---|---|---|---|---|---|"]
    for arm, m in res["arms"].items():
        lines.append(f"| {arm} | {fmt(m['tokens_per_s'], 1)} | {fmt(m['speedup'], 2, '×')} | {fmt(m['tau'])} | "
                     f"{fmt(m['mean_tree_tokens'], 1)} | {fmt(m['lossless'])} |")
    curves = res["curves_s"]
    sizes = sorted({int(k) for c in curves.values() for k in c}, key=int)
    lines += ["", "c(T) in ms at the 256-token reference context (measured, and after the run's corrections):", "",
              "| curve | " + " | ".join(f"T={n}" for n in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for name, c in curves.items():
        lines.append(f"| {name} | " + " | ".join(ms(c.get(str(n))) for n in sizes) + " |")
    return lines


def _paired_cell(level: dict) -> str:
    """An A/B level's paired tokens/s ratios: the median, each repeat's, and how many favoured arm one."""
    ratios = level["ratio_tokens_per_s_paired"]
    return (f"{fmt(level['ratio_median'], 2, '×')} median ({', '.join(fmt(r, 2) for r in ratios)}); faster in "
            f"{level['repeats_faster']} of {len(ratios)}")


@renderer("fold_prefills")
def render_fold_prefills(res: dict) -> list[str]:
    """Prefills folded into the step against their own forwards (or chunked against whole prompts,
    or the goodput rule with its payoff veto against without): per N and arm, medians over repeats."""
    names = list(next(iter(res["concurrency"].values()))["arms"])
    verdicts = any(m.get("goodput_verdicts") for level in res["concurrency"].values() for m in level["arms"].values())
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, method `{res['method']}`"
             f"{' (goodput rule)' if res.get('goodput') else ''}: {res['prompts']} Spec-Bench first turns, "
             f"{res['max_new_tokens']} new tokens each, closed loop; medians of {res['repeats']} repeats, arms "
             "alternating run by run.", "",
             f"| N | arm | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 / max ms | lossless | {' / '.join(names)} tok/s (paired) |"
             + (" rule's verdicts, draft / probe / retest / skip / veto |" if verdicts else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if verdicts else "")]
    for n, level in res["concurrency"].items():
        for i, (arm, m) in enumerate(level["arms"].items()):
            cell = _paired_cell(level) if i == 0 else ""
            v = m.get("goodput_verdicts")
            shares = (" " + " / ".join(f"{100 * v[k]:.0f}%" for k in VERDICTS)
                      + " |") if v else (" – |" if verdicts else "")
            lines.append(f"| {n} | {arm} | {fmt(m['tokens_per_s'], 1)} | {ms(m['ttft_p50_s'])} / {ms(m['ttft_p99_s'])} "
                         f"| {ms(m['itl_p50_s'])} / {ms(m['itl_p99_s'])} / {ms(m.get('itl_max_s'))} | {fmt(m['lossless'])} | {cell} |"
                         + shares)
    saturated = [(n, level) for n, level in res["concurrency"].items() if "saturated_ratio_paired" in level]
    if saturated:
        lines += ["", "The saturated window (from the start until the first client finds the dataset exhausted: every "
                      "client busy), per N: medians over repeats and the paired ratio.", "",
                  f"| N | {' | '.join(f'{a} saturated tok/s' for a in names)} | {' / '.join(names)} (paired) |",
                  "|---|" + "---|" * len(names) + "---|"]
        for n, level in saturated:
            ratios = level["saturated_ratio_paired"]
            lines.append(f"| {n} | " + " | ".join(fmt(level['arms'][a]['saturated_tokens_per_s'], 1) for a in names)
                         + f" | {fmt(level['saturated_ratio_median'], 2, '×')} median "
                           f"({', '.join(fmt(r, 2) for r in ratios)}); faster in {sum(r > 1.0 for r in ratios)} "
                           f"of {len(ratios)} |")
    return lines


def _ab_closed_loop(res: dict, ratio: str) -> list[str]:
    """An A/B script's closed-loop table (``speculation.bench.ab``): per N and arm, medians and the
    paired ``ratio`` (first arm over second)."""
    lines = [f"| N | arm | tok/s | TTFT p50 ms | ITL p50 / p99 ms | lossless (per repeat) | {ratio} tok/s (paired) |",
             "|---|---|---|---|---|---|---|"]
    for n, level in res["concurrency"].items():
        for i, (arm, m) in enumerate(level["arms"].items()):
            cell = _paired_cell(level) if i == 0 else ""
            lossless = ", ".join(fmt(x) for x in m["lossless"])
            lines.append(f"| {n} | {arm} | {fmt(m['tokens_per_s'], 1)} | {ms(m['ttft_p50_s'])} "
                         f"| {ms(m['itl_p50_s'])} / {ms(m['itl_p99_s'])} | {lossless} | {cell} |")
    return lines


@renderer("single_query_attention")
def render_single_query_attention(res: dict) -> list[str]:
    """The one-query attention kernel, half precision against widened, then the closed-loop A/B."""
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, method `{res['method']}`: one layer's "
             "attention call for one query token over n keys (median µs), then the closed loop on "
             f"{res['prompts']} Spec-Bench first turns, {res['max_new_tokens']} new tokens each; medians of "
             f"{res['repeats']} repeats, arms alternating run by run.", "",
             "| keys | half µs | widened µs | half / widened |", "|---|---|---|---|"]
    for k in res["kernel"]:
        lines.append(f"| {k['keys']} | {k['half_us']:.0f} | {k['widened_us']:.0f} | {fmt(k['ratio'], 2, '×')} |")
    return lines + ["", *_ab_closed_loop(res, "widened / half")]


@renderer("batch_invariant")
def render_batch_invariant(res: dict) -> list[str]:
    """Batch-invariant mode against the default: the products per row count, then the closed-loop A/B."""
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, method `{res['method']}`: each distinct "
             "product of the target, its probed invariant limit (rows; – = the kernel never switched) and "
             "the median µs of one product of M rows, default / invariant; then the closed loop on "
             f"{res['prompts']} Spec-Bench first turns, {res['max_new_tokens']} new tokens each, arriving "
             f"prompts folded into the step; medians of {res['repeats']} repeats, arms alternating run by "
             "run, `lossless` against each arm's own solo vanilla outputs. Solo outputs that differ between "
             f"the modes: {res['solo_outputs_differing_between_modes']} of {res['prompts']}.", ""]
    ms = list(next(iter(res["kernel"]))["us"]["default"]) if res["kernel"] else []
    lines += ["| product [N, K] | limit | " + " | ".join(f"M = {m} µs" for m in ms) + " |",
              "|---|---|" + "---|" * len(ms)]
    for k in res["kernel"]:
        us = k["us"]
        lines.append(f"| {k['shape']} | {fmt(k['limit'], 0)} | " + " | ".join(
            f"{us['default'][m]:.0f} / {us['invariant'][m]:.0f}" for m in ms) + " |")
    return lines + ["", *_ab_closed_loop(res, "invariant / default")]
