"""Online adaptation: adapt-bench rounds, gate decisions, harmful-update audits, online knobs."""

from __future__ import annotations

from adaptation.gain import break_even_horizon_s
from benchmarks.render.base import fmt, renderer
from graftblock.adapt import HARMFUL_POLICY, RECOVERY_WINDOW, RECOVERY_WITHIN, recovery_requests


def _fires_at(gain: dict, cost_s: float | None, horizon_s: float | None) -> str:
    """The break-even horizon H* = H * C / G_lo of a replayed round (``adaptation.gain``), from the
    recorded G_lo, C and H, so results written before the field existed get it too."""
    lo = gain.get("gain_lo_s")
    if lo is None or cost_s is None or horizon_s is None:
        return "–"
    h = break_even_horizon_s(lo, cost_s, horizon_s)
    return "never (G_lo ≤ 0)" if h == float("inf") else fmt(h, 0)


def _cost_total_s(cost: dict) -> float:
    """C(a) of a serialised ``CostEstimate`` (its ``total_s`` property is not in the JSON)."""
    return cost["train_s"] * cost["contention"] + cost["sync_s"]


@renderer("adapt_bench")
def render_adapt(res: dict) -> list[str]:
    """adapt-bench: policies on one domain-shifting stream, tokens/s net of update cost, decisions."""
    pol = res["policies"]
    static = pol.get("static", {}).get("tokens_per_s")
    reqs = ", ".join(f"{k} {v}" for k, v in res["requests_per_phase"].items())
    c = res.get("controller", {})
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, drafter `{res['drafter']}`, stream "
             f"`{res['stream']}` (requests per phase: {reqs}), {res['max_new_tokens']} new tokens, greedy; requests "
             f"interleaved policy by policy on the same cores, each policy with its own copy of the drafter. "
             f"Controller: a round every {c.get('decide_every_steps')} verify steps, horizon {c.get('horizon_s')} s, "
             f"bandit budgets {c.get('budgets')}, always-update {c.get('fixed_budget')} steps, periodic "
             f"{c.get('periodic_budget')} steps every {c.get('periodic_rounds')} rounds, guard window "
             f"{c.get('guard_window')} steps ({c.get('guard_mode', 'live')}), lr {c.get('lr')}, accepted positions kept in the loss "
             f"{c.get('accepted_keep', 0.25)}; cost_aware explores "
             + ("every budget once" if c.get("explore_after_harm", True) else
                "budgets cheapest first, skipping dearer ones after a harmful estimate")
             + (f"; no candidate before {c['min_train_positions']} train positions, an arm re-tried once the "
                f"train part grows {c['retry_growth']}-fold" if "retry_growth" in c else
                "; no data floor, no re-tries (before both existed)")
             + (f"; updated weights audited against the start weights when live tau drops between "
                f"{c['audit_window']}-step windows" if c.get("audit_window") else "") + ".", "",
             "| policy | tok/s (update cost included) | vs static | tau | updates | rollbacks | gated | update cost s "
             "| regret s | lossless |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in pol.items():
        ratio = p["tokens_per_s"] / static if static else None
        back = f"{p['rollbacks']}" + (f" + {p['reverts']} reverted by audit" if p.get("reverts") else "")
        lines.append(f"| {name} | {fmt(p['tokens_per_s'], 2)} | {fmt(ratio, 3, '×')} | {fmt(p['tau'], 3)} | {p['updates']} | "
                     f"{back} | {p['gated']} | {fmt(p['cost_s'], 1)} | {fmt(p.get('regret'), 1)} | "
                     f"{fmt(p['lossless'])} |")
    phases = res["phases"]
    lines += ["", "Per phase, tok/s (tau):", "", "| policy | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
    for name, p in pol.items():
        lines.append(f"| {name} | " + " | ".join(f"{fmt(p['per_phase'][ph]['tokens_per_s'], 2)} "
                                                 f"({fmt(p['per_phase'][ph]['tau'], 2)})" for ph in phases) + " |")
    if len(phases) > 1:
        lines += ["", f"Recovery after each shift: requests into the phase until tau (trailing mean of "
                  f"{RECOVERY_WINDOW}) is within {RECOVERY_WITHIN:.0%} of its phase-end value (1 = no dip; – = never):",
                  "", "| policy | " + " | ".join(phases[1:]) + " |", "|---|" + "---|" * (len(phases) - 1)]
        for name, p in pol.items():
            rec = p.get("recovery_requests") or recovery_requests(p["tau_series"], p["phase_series"])
            lines.append(f"| {name} | " + " | ".join(fmt(rec.get(ph), 0) for ph in phases[1:]) + " |")
    for name, p in pol.items():
        rounds = [d for d in p.get("decisions", []) if d.get("outcome") != "skipped"]
        if not rounds or (name == HARMFUL_POLICY and "harmful" in res):  # its swap: the block below
            continue
        if not any(d.get("gain") for d in rounds):  # always / periodic: no estimate, just the spend
            costs = [_cost_total_s(d["cost"]) for d in rounds if d.get("cost")]
            outcomes = sorted({d["outcome"] for d in rounds})
            lines += ["", f"`{name}`: {len(rounds)} of {len(p.get('decisions', []))} rounds trained "
                      f"({', '.join(outcomes)}; arms {sorted({d['arm'] for d in rounds})} steps), priced cost "
                      f"{fmt(min(costs), 1)}–{fmt(max(costs), 1)} s per round; no gain is estimated by this policy."]
            continue
        lines += ["", f"`{name}`: rounds that trained ({len(rounds)} of {len(p.get('decisions', []))} rounds; "
                  "G = expected gain over the horizon with its confidence interval, C = priced cost):", "",
                  "| round | arm (steps) | outcome | tau old | tau new [CI] | G s [CI] | C s | fires at horizon s "
                  "| realised s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for d in rounds:
            g = d.get("gain") or {}
            total = _cost_total_s(d["cost"]) if d.get("cost") else None
            if not g and d.get("outcome") in ("audited", "reverted"):  # start vs live weights, replayed
                total = (d.get("cost") or {}).get("replay_s")
                lines.append(f"| {d['round']} | audit | {d['outcome']} | {fmt(d.get('tau_replay_prev'), 3)} (start) | "
                             f"{fmt(d.get('tau_replay_new'), 3)} (live) | – | {fmt(total, 2)} (replay) | – | – |")
                continue
            lines.append(f"| {d['round']} | {d['arm']} | {d['outcome']} | {fmt(g.get('tau_old'), 3)} | "
                         f"{fmt(g.get('tau_new'), 3)} [{fmt(g.get('tau_new_lo'), 3)}, {fmt(g.get('tau_new_hi'), 3)}] | "
                         f"{fmt(g.get('gain_s'), 2)} [{fmt(g.get('gain_lo_s'), 2)}, {fmt(g.get('gain_hi_s'), 2)}] | "
                         f"{fmt(total, 2)} | {_fires_at(g, total, c.get('horizon_s'))} | "
                         f"{fmt(d.get('realised_gain_s'), 2)} |")
    if "harmful" in res:
        lines += ["", *_harmful_lines(res["harmful"])]
    return lines


def _harmful_lines(h: dict) -> list[str]:
    """adapt-bench's harmful block: the injected swap, the guard's verdict, its cost against static."""
    if h.get("closed_as") is None:
        verdict = "The guard's watch had not closed by the end of the stream."
    else:
        verdict = (f"The guard closed its watch as **{h['closed_as']}** during request {h['rollback_request']}, "
                   f"{h['requests_to_rollback']} request(s) after the swap counting the swap's own. Replayed on the "
                   f"watch window's text: previous weights tau {fmt(h.get('tau_replay_prev'), 3)}, shuffled head "
                   f"{fmt(h.get('tau_replay_new'), 3)}; live tau {fmt(h.get('tau_pre'), 3)} in the window before the swap, "
                   f"{fmt(h.get('tau_post'), 3)} in the watch window. The guard's replays cost "
                   f"{fmt(h.get('guard_replay_s'), 2)} s.")
    return [f"**Deliberately harmful update** (`{HARMFUL_POLICY}`: static, plus the draft head's rows shuffled, "
            f"seed {h.get('seed')}, published before request {h['at_request']} of phase `{h['phase']}`; guard window "
            f"{h['watch_steps']} verify steps, {h.get('guard_mode')}). {verdict}", "",
            "| tokens/s, harmful / static | ratio |", "|---|---|",
            f"| phase `{h['phase']}` | {fmt(h['phase_tokens_per_s'], 3, '×')} |",
            f"| the {h['affected_requests']} request(s) from the swap to the guard's verdict | "
            f"{fmt(h['affected_tokens_per_s'], 3, '×')} |"] + (
        [f"| the {h['before_swap_requests']} requests of the phase before the swap (same weights in both: noise) | "
         f"{fmt(h['before_swap_tokens_per_s'], 3, '×')} |"] if h.get("before_swap_tokens_per_s") is not None else []) + (
        ["", f"The affected request(s) took {fmt(h['affected_extra_s'], 2)} s beyond static's same requests: "
             f"**{fmt(100 * h['cost_share_of_phase'], 2)}%** of the harmful policy's {fmt(h['phase_serving_s'], 1)} s "
             f"serving the phase (read on the swap's own requests, so the phase's request-to-request noise, "
             f"the row above, does not enter)."] if h.get("cost_share_of_phase") is not None else [])


@renderer("online_knobs")
def render_online_knobs(res: dict) -> list[str]:
    """Candidate updates over a knob grid: held-out and train replay tau against the live weights."""
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, drafter `{res['drafter']}`; phase `{res['phase']}` of "
             f"`{res['stream']}`: {res['requests']} requests of {res['max_new_tokens']} tokens served greedily "
             f"(live tau {fmt(res['live_tau'], 3)}), the last {res['heldout']} held out ({res['heldout_units']} replay "
             f"units of {res['chunk']} positions). Every candidate starts from the live weights.", "",
             "| train requests (positions) | lr | accepted kept | steps | loss | train s | held-out tau: live → candidate [CI] "
             "| train tau: live → candidate |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lo, hi = r["tau_heldout_new_ci"]
        lines.append(f"| {r['train_requests']} ({r['train_positions']}) | {r['lr']:g} | {r['accepted_keep']:g} | {r['steps']} | "
                     f"{fmt(r['mean_loss'], 3)} | {fmt(r['train_s'], 0)} | {fmt(r['tau_heldout_old'], 3)} → "
                     f"**{fmt(r['tau_heldout_new'], 3)}** [{fmt(lo, 3)}, {fmt(hi, 3)}] | {fmt(r['tau_train_old'], 3)} → "
                     f"{fmt(r['tau_train_new'], 3)} |")
    return lines
