"""Optuna sweeps: the trials and the best configuration on held-out categories."""

from __future__ import annotations

import json

from benchmarks.render.base import dataset_label, dataset_note, fmt, renderer


@renderer("sweep_heldout")
def render_sweep_heldout(res: dict) -> list[str]:
    """A sweep's trials, then its best configuration on the sweep's categories and on held-out ones."""
    b = res["best"]
    cfg = res["bench_config"]
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, method `{res['method']}` with fixed "
             f"`{json.dumps(res['fixed'])}`; study `{res['study']}`, objective {res['objective']}; "
             f"dataset `{dataset_label(cfg['dataset'])}`{dataset_note(cfg['dataset'])}, "
             f"{cfg['limit_per_category']} questions per category, "
             f"{cfg['max_new_tokens']} new tokens, greedy. Sweep categories: {', '.join(res['sweep_categories'])}; "
             f"held out: {', '.join(res['holdout_categories'])}.", "",
             "| trial | " + " | ".join(res["knobs"]) + " | speedup | tau | tree | drafting share | status |",
             "|---|" + "---|" * (len(res["knobs"]) + 5)]
    for t in res["trials"]:
        m = t["metrics"]
        mark = " (best)" if t["trial_number"] == b["trial_number"] else ""
        lines.append(f"| {t['trial_number']}{mark} | " + " | ".join(fmt(t["params"].get(k), 2) if isinstance(t["params"].get(k), float)
                                                                     else str(t["params"].get(k)) for k in res["knobs"])
                     + f" | {fmt(m.get('speedup'), 2, '×')} | {fmt(m.get('tau'))} | {fmt(m.get('mean_tree_size'), 1)} | "
                     f"{fmt(m.get('drafting_share'), 3)} | {t['status']} |")
    lines += ["", f"Best trial {b['trial_number']}, on the sweep's categories and on the held-out ones "
              "(each against vanilla on the same prompts in the same run):", "",
              "| prompts | vanilla tok/s | speedup | tau | tree | drafting share | lossless |", "|---|---|---|---|---|---|---|"]
    for name, key in (("sweep categories", "sweep"), ("held-out categories", "holdout")):
        m = b[key]
        lines.append(f"| {name} | {fmt(b[f'{key}_vanilla_tokens_per_s'], 1)} | {fmt(m.get('speedup'), 2, '×')} | "
                     f"{fmt(m.get('tau'))} | {fmt(m.get('mean_tree_size'), 1)} | {fmt(m.get('drafting_share'), 3)} | "
                     f"{fmt(b[f'{key}_lossless'])} |")
    per = {**b["sweep_per_category"], **b["holdout_per_category"]}
    lines += ["", "Speedup (tau) per category, sweep categories first:", "",
              "| " + " | ".join(per) + " |", "|" + "---|" * len(per),
              "| " + " | ".join(f"{fmt(v.get('speedup'), 2, '×')} ({fmt(v.get('tau'))})" for v in per.values()) + " |"]
    return lines
