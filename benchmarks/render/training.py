"""Drafter training: held-out tau against training tokens, per data source (``benchmarks/data_scaling.py``)."""

from __future__ import annotations

from benchmarks.render.base import fmt, renderer


def _tokens(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.{0 if n >= 100 * size else 1}f}{unit}"
    return f"{n:.0f}"


def _reach(r: dict | None) -> str:
    if r is None:
        return "not reached (the fit does not rise)"
    return f"{_tokens(r['tokens'])} tokens ≈ {fmt(r['cpu_hours'], 0)} CPU-h"


def _tree(tree: dict) -> str:
    """The evaluation tree in its own knobs: every key but the total, in the order recorded."""
    knobs = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in tree.items() if k != "total_tokens")
    return f"{tree.get('total_tokens', '?')} tokens" + (f", {knobs}" if knobs else "")


@renderer("data_scaling")
def render_data_scaling(res: dict) -> list[str]:
    """One row per training run, its curve point by point, and tau at equal training tokens."""
    curves = res["curves"]
    ev = res.get("eval", {})
    tree = ev.get("eval_tree") or {}
    lines = [f"Family **{res['family']}**, target **{res['model']}**, dtype **{res['dtype']}**. Every point is real "
             f"greedy speculative decoding of {ev.get('eval_prompts', '?')} held-out ShareGPT prompts "
             f"({ev.get('eval_max_new_tokens', '?')} new tokens each; tree {_tree(tree)}), prompts the runs never trained on "
             "and not in Spec-Bench. Equal training tokens are equal compute: the same network, loss, batch plan and "
             "schedule per token; only the answers differ.", "",
             "| run | data | tokens trained | wall min | of it tau evals, min | tokens/s training (end to end) | final tau | "
             "fit: tau per doubling | "
             f"to tau {res['tau_targets'][0]} | to tau {res['tau_targets'][1]} |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in curves:
        last = next((p["tau"] for p in reversed(c["points"]) if p["tau"] is not None), None)
        f = c.get("fit")
        fit = (f"{fmt(f['b_per_doubling'], 3)} (a = {fmt(f['a'], 2)}, {f['points']} points, "
               f"{_tokens(f['fitted_tokens'][0])}–{_tokens(f['fitted_tokens'][1])}, rmse {fmt(f['rmse'], 3)})"
               if f else "–")
        reach = c.get("reach", {})
        rate = (f"{fmt(c['tokens_per_s'], 0)} ({fmt(c.get('tokens_per_s_end_to_end'), 0)})"
                if c.get("rate_basis") == "training" else f"– ({fmt(c['tokens_per_s'], 0)})")
        evals = c.get("eval_s")
        lines.append(f"| {c['label']} | `{c['data']}` | {_tokens(c['tokens'])} | {fmt(c['wall_s'] / 60, 1)} | "
                     f"{fmt(evals / 60 if evals is not None else None, 1)} | {rate} | {fmt(last)} | {fit} | {_reach(reach.get(str(res['tau_targets'][0])))} | "
                     f"{_reach(reach.get(str(res['tau_targets'][1])))} |")
    lines += ["", "CPU-hours at each run's own training rate (1 core per run; the target's feature extraction "
              "included, the tau evaluations not; the end-to-end rate where the evaluation times are unknown), "
              "extrapolated from a log-linear fit far beyond its points: an order of magnitude, not a forecast.", ""]
    for c in curves:
        fc = c.get("feature_cache")
        if fc and fc.get("bytes_per_million_tokens"):
            lines.append(f"- {c['label']}: feature cache `{fc['dir']}` holds {_tokens(fc['tokens'])} tokens in "
                         f"{fmt(fc['bytes'] / 2 ** 20, 0)} MiB, **{fmt(fc['bytes_per_million_tokens'] / 2 ** 30, 2)} GiB per "
                         "million tokens** (bf16 aux features, target top-k logits, ids, loss mask).")
    lines += ["",
              "| run | tokens | tau | accepting ≥ 1 | ≥ 2 | ≥ 3 | ≥ 4 | wall min so far |", "|---|---|---|---|---|---|---|---|"]
    for c in curves:
        for p in c["points"]:
            ge = (p.get("accept_ge") or []) + [None] * 4
            lines.append(f"| {c['label']} | {_tokens(p['tokens'])} | {fmt(p['tau'])} | "
                         + " | ".join(fmt(ge[j]) for j in range(4))
                         + f" | {fmt(p['elapsed_s'] / 60 if p.get('elapsed_s') is not None else None, 1)} |")
    if res.get("equal_tokens"):
        lines += ["", "| tokens | ratio | of |", "|---|---|---|"]
        for e in res["equal_tokens"]:
            lines.append(f"| {_tokens(e['tokens'])} | **{fmt(e['ratio'], 2, '×')}** | {e['of']} |")
    return lines
