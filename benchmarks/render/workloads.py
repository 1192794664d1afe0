"""Workloads: retrieval scaling, the suffix store's memory, long context."""

from __future__ import annotations

from benchmarks.render.base import fmt, renderer


@renderer("retrieval_scaling")
def render_scaling(res: dict) -> list[str]:
    lines = [f"Model **{res['model']}**, {res['steps']} proposals per context length; retrieval config as in the "
             "JSON.", "", "| context tokens | median ms | p90 ms | mean tree size |", "|---|---|---|---|"]
    for n, r in sorted(res["results"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {n} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} | {r['mean_tree_size']:.1f} |")
    return lines


@renderer("suffix_store_memory")
def render_suffix_store_memory(res: dict) -> list[str]:
    """Memory per million stored tokens, insert rate and lookup latency of the cross-request store."""
    lines = [f"Documents: {res['source']}, tokenized with {res['tokenizer']}; lookups on held-out conversations.", "",
             "| run | capacity | fed | stored | docs (evicted) | MiB per million tokens | add tok/s "
             "| lookup median µs | p90 µs | matched | mean match length |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ("fill", "bounded"):
        r = res[name]
        lines.append(f"| {name} | {r['capacity_tokens']} | {r['fed_tokens']} | {r['stored_tokens']} | {r['docs']} "
                     f"({r['evicted_docs']}) | {fmt(r['mib_per_million_tokens'], 1)} | {fmt(r['add_tokens_per_s'], 0)} | "
                     f"{fmt(r['median_us'], 1)} | {fmt(r['p90_us'], 1)} | {fmt(r['match_rate'])} | "
                     f"{fmt(r['mean_match_len'], 1)} |")
    return lines


@renderer("kv_sized")
def render_kv_sized(res: dict) -> list[str]:
    """Fixed KV slots against slots sized per request: pool bytes, wall time, identical tokens."""
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**. {res['max_sequences']} requests queued at once, "
             f"prompts of {', '.join(str(n) for n in res['prompt_tokens'])} tokens, {res['new_tokens']} new tokens "
             f"each (greedy, retrieval); every slot may hold {res['slot_rows']} rows. `sized` has "
             "`batch.kv_token_budget` = the fixed pool's rows, so both admit the same requests at the same steps.", "",
             "| mode | peak KV MiB | mean KV MiB | steps | wall s (median of runs) | runs |", "|---|---|---|---|---|---|"]
    for mode in ("fixed", "sized"):
        r = res["runs"][mode]
        lines.append(f"| {mode} | {fmt(r['peak_bytes'] / 2**20, 0)} | {fmt(r['mean_bytes'] / 2**20, 0)} | {r['steps']} | "
                     f"{fmt(r['median_wall_s'])} | {', '.join(fmt(w) for w in r['wall_s'])} |")
    lines += ["", f"Peak memory sized / fixed: **{fmt(res['peak_memory_ratio'])}**; wall sized / fixed: "
              f"{fmt(res['wall_ratio_sized_over_fixed'])}; tokens identical in every run: "
              f"**{res['identical_tokens']}**."]
    return lines


@renderer("long_context")
def render_long_context(res: dict) -> list[str]:
    """c(T, L) from 512 to 8K tokens, then each longdoc workload's methods against vanilla."""
    curve = res.get("verify_cost", {})
    sizes = sorted({int(t) for row in curve.values() for t in row})
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**. Verify cost c(T, L) (one tree forward + KV "
             "commit over L committed tokens; median) and, in brackets, c(T, L) / c(1, L):", "",
             "| L | " + " | ".join(f"T={t}" for t in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for ctx, row in sorted(curve.items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {ctx} | " + " | ".join(
            f"{1000 * row[str(t)]:.1f} ms ({row[str(t)] / row['1']:.2f})" for t in sizes) + " |")
    pred = res.get("predicted_cost")
    if pred:
        measured_at = ", ".join(str(c) for c in pred["contexts_measured"])
        lines += ["", f"What the drafters' cost model predicts at the same points (measured at L = {measured_at}; "
                  "linear in L beyond the longest) and, in brackets, predicted / measured above:", "",
                  "| L | " + " | ".join(f"T={t}" for t in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
        for ctx, row in sorted(pred["grid"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {ctx} | " + " | ".join(
                f"{1000 * row[str(t)]:.1f} ms ({row[str(t)] / curve[ctx][str(t)]:.2f})" for t in sizes) + " |")
    runs = res.get("workloads", {})
    if runs:
        lines += ["", "tok/s and speedup count the prefill (Spec-Bench's speed); decode tok/s = new tokens / (wall "
                  "- prefill seconds), the decode loop alone.", "",
                  "| workload | prompt tokens (mean) | method | tok/s | speedup | prefill s/turn | decode tok/s "
                  "| decode speedup | tau | tree | draft ms/step | verify ms/step | lossless |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in runs.items():
            mean_prompt = sum(r["prompt_tokens"]) / len(r["prompt_tokens"])
            for m_name, m in r["methods"].items():
                prefill = m["prefill_s"] / m["n_turns"] if "prefill_s" in m else None
                speedup = 1.0 if m_name == "vanilla" and "decode_tokens_per_s" in m else m.get("decode_speedup")
                verify = m.get("verify_s_per_step") or None
                lines.append(f"| {name} | {mean_prompt:.0f} | {m_name} | {fmt(m['tokens_per_s'], 1)} | "
                             f"{fmt(m['speedup'], 2, '×')} | {fmt(prefill, 1)} | {fmt(m.get('decode_tokens_per_s'), 1)} | "
                             f"{fmt(speedup, 2, '×')} | {fmt(m['tau'])} | {fmt(m.get('mean_tree_size'), 1)} | "
                             f"{fmt(1000 * m['drafting_s_per_step'], 1)} | {fmt(verify and 1000 * verify, 1)} | "
                             f"{fmt(m['lossless'])} |")
    return lines
