"""``graftblock bench`` results: the methods table, prefill, drafter details, the suffix store, the verify curve."""

from __future__ import annotations

from benchmarks.render.base import BENCH_KIND, WORKLOAD_DATASETS, dataset_label, dataset_note, fmt, renderer, tau_of, unavailable
from benchmarks.render.batching import render_concurrency


def render_bench(res: dict) -> list[str]:
    lines = [
        f"Model **{res['model']}**, dtype **{res['dtype']}**, "
        f"dataset `{dataset_label(res['dataset'])}`{dataset_note(res['dataset'])}: {res['n_prompts']} questions "
        f"({res['n_turns']} turns), {res['max_new_tokens']} new tokens per turn, temperature {res['temperature']}. "
        f"Vanilla: {fmt(res['baseline_tokens_per_s'], 1)} tok/s.",
        "",
        "| method | tok/s | speedup | tau | tree | draft share | draft ms/step | verify ms/step | drafter fwd/step | lossless |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = list(res["methods"].items()) + [(f"peer: {k}", v) for k, v in res.get("peers", {}).items()]
    for name, m in rows:
        ds = m.get("drafting_s_per_step")
        vs = m.get("verify_s_per_step")
        lines.append(
            f"| {name} | {fmt(m['tokens_per_s'], 1)} | {fmt(m['speedup'], 2, '×')} | {fmt(tau_of(m))} | "
            f"{fmt(m.get('mean_tree_size'), 1)} | {fmt(m.get('drafting_share'), 3)} | "
            f"{fmt(ds * 1000 if ds is not None else None)} | {fmt(vs * 1000 if vs is not None else None, 1)} | "
            f"{fmt(m.get('drafter_forwards_per_step'), 1)} | {fmt(m.get('lossless'))} |"
        )
    lines += unavailable(res.get("peers_unavailable"))
    lines += _prefill_lines(res, rows)
    cats = res.get("categories", [])
    lines += ["", "Speedup (tau) per category:", ""]
    lines.append("| method | " + " | ".join(cats) + " |")
    lines.append("|---|" + "---|" * len(cats))
    for name, m in rows:
        cells = []
        for c in cats:
            pc = m.get("per_category", {}).get(c)
            if pc is None:
                cells.append("–")
            elif pc.get("tau") is None or name.startswith("peer") or name == "vanilla":
                cells.append(fmt(pc["speedup"], 2, "×"))
            else:
                cells.append(f"{fmt(pc['speedup'], 2, '×')} ({fmt(pc['tau'])})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _prefill_lines(res: dict, rows: list[tuple[str, dict]]) -> list[str]:
    """How prompts were prefilled: the chunk grid, and what each method's prefix cache reused."""
    chunk = res.get("prefill_chunk_tokens")
    if chunk is None:
        return []
    line = f"Prompts prefilled in {chunk}-token chunks."
    pc = res.get("prefix_cache")
    if pc:
        shares = [f"{name} {fmt(m['prefix_cache']['reused_share'], 2)}" for name, m in rows if "prefix_cache" in m]
        line += (f" Prefix cache on (`--prefix-cache`, {pc['max_tokens']} rows per method): each method reuses "
                 "the prompt rows of its own earlier turns, as vLLM's automatic prefix caching does for the vLLM "
                 f"peers; share of prompt tokens reused: {', '.join(shares)}.")
    prefill = [f"{name} {fmt(m['prefill_s'] / m['n_turns'], 2)}" for name, m in rows
               if m.get("prefill_s") and m.get("n_turns")]
    if prefill:
        line += f" Prefill seconds per turn: {', '.join(prefill)} (HF peers report none; a vLLM peer's is its time to first token)."
    return ["", line]


def render_drafter_details(res: dict) -> list[str]:
    """Per-step drafter statistics (Graft's stages and grafts) and acceptance per depth."""
    rows = [(n, m) for n, m in res["methods"].items() if m.get("acceptance_per_depth")]
    if not rows:
        return []
    lines = ["", "Acceptance per depth (share of steps whose tree reached depth d that accepted >= d tokens; "
             "plot: see below) and where accepted tokens came from:", "",
             "| method | d=1 | d=2 | d=3 | d=4 | d=5 | d=6 | d=7 | d=8 | accepted from retrieval "
             "| steps per stage (stages ascending) | grafted nodes/step | drafter nodes/step | blocks/step "
             "| assembly µs/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in rows:
        acc = (m.get("acceptance_per_depth") or []) + [None] * 8
        share = (m.get("accepted_share_by_source") or {}).get("retrieval")
        st = m.get("drafter_stats") or {}
        stages = sorted(int(k.split("_")[1]) for k in st if k.startswith("stage_"))
        shares = " / ".join(f"{fmt(st[f'stage_{s}'], 2)}" for s in stages) if stages else "–"
        asm = st.get("assembly_s")
        lines.append(
            f"| {name} | " + " | ".join(fmt(a) for a in acc[:8]) + f" | {fmt(share, 2)} | {shares} | "
            f"{fmt(st.get('grafted'), 1)} | {fmt(st.get('drafter_nodes'), 1)} | {fmt(st.get('blocks'), 2)} | "
            f"{fmt(asm * 1e6 if asm is not None else None, 0)} |"
        )
    return lines


@renderer("verify_curve")
def render_curve(res: dict) -> list[str]:
    lines = [f"Model **{res['model']}**; median seconds of one verify + KV commit over a 256-token context.", ""]
    curves = res["curves"]
    sizes = sorted({int(k) for c in curves.values() for k in c["seconds"]})
    lines.append("| dtype | " + " | ".join(f"T={s}" for s in sizes) + " | c(T)/c(1) at T=32 |")
    lines.append("|---|" + "---|" * (len(sizes) + 1))
    for dt, c in curves.items():
        secs = {int(k): v for k, v in c["seconds"].items()}
        ratio = secs.get(32, float("nan")) / secs[1] if 1 in secs else float("nan")
        lines.append(f"| {dt} | " + " | ".join(f"{1000 * secs[s]:.0f} ms" if s in secs else "–" for s in sizes)
                     + f" | {ratio:.2f} |")
    return lines


def render_store(res: dict) -> list[str]:
    """The cross-request suffix store of each method that had one: what it held at the end, how
    often it matched and how much of each tree it drafted."""
    rows = [(n, m) for n, m in res["methods"].items() if (m.get("drafter_report") or {}).get("suffix_store")]
    if not rows:
        return []
    lines = ["", "Cross-request suffix store at the end of the run:", "",
             "| method | documents | tokens | evicted | lookups matched | hits | store nodes/step | match length |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in rows:
        st, ds = m["drafter_report"]["suffix_store"], m.get("drafter_stats") or {}
        lines.append(f"| {name} | {st['docs']} | {st['tokens']} | {st['evicted_docs']} | {fmt(st['match_rate'])} | "
                     f"{st['hits']} | {fmt(ds.get('store_nodes'), 2)} | {fmt(ds.get('store_match_len'), 2)} |")
    return lines


@renderer(BENCH_KIND)
def render_bench_result(res: dict) -> list[str]:
    """A ``graftblock bench`` result (no ``kind`` field): the methods table, per-depth acceptance where a
    feature drafter ran or the dataset is a workload, the suffix store, and the closed loop where
    ``--concurrency`` was given."""
    out = render_bench(res)
    if (any(m.get("config", {}).get("type") in ("eagle3", "graft", "specblock") for m in res["methods"].values())
            or res.get("dataset") in WORKLOAD_DATASETS):
        out += render_drafter_details(res)
    out += render_store(res)
    if res.get("concurrency"):
        out += render_concurrency(res)
    return out
