"""``graftblock report``: BENCHMARKS.md, benchmarks/archive.md and README's headline, generated.

    graftblock report            # rewrites the three from benchmarks/results/*.json + benchmarks/notes/*.md
    graftblock report --check    # exit 1, naming what is stale, where a committed file differs

BENCHMARKS.md is summary first: (1) the verdict table (question, target, measured, date,
command, link), (2) a table of contents, (3) the sections grouped by question, newest run first
within a group. Superseded runs (``ARCHIVE``) go to ``benchmarks/archive.md`` instead. Every
figure is read from the JSON (the tables by ``benchmarks/render/``'s registry, the verdict and
headline cells by the ``Claim`` functions below); the notes are hand-written prose beside them.
This module is library code: it imports ``benchmarks.render``, never the CLI.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks import render
from benchmarks.render import ROOT, RESULTS, command_of, fmt, kind_of, title_of

BENCHMARKS = ROOT / "BENCHMARKS.md"
ARCHIVE = ROOT / "benchmarks" / "archive.md"
README = ROOT / "README.md"
HEADLINE_BEGIN = "<!-- headline:begin -->"
HEADLINE_END = "<!-- headline:end -->"

GROUPS: dict[str, str] = {
    "workloads": "Workloads where speculation pays: code editing, agents, long documents",
    "drafters": "Drafters and acceptance: retrieval against vanilla and Hugging Face peers",
    "training": "Drafter training: the target's own data, and tau against training tokens",
    "graft": "Graft: grafting retrieval onto a feature drafter's tree",
    "specblock": "SpecBlock: block drafting with a rank head",
    "batching": "Continuous batching and the goodput rule",
    "serving": "Serving and the Ray actor path",
    "adaptation": "Online adaptation and the learner",
    "kernels": "Kernels and the cost model",
    "peers": "Peers: vLLM",
}
"""Group key -> heading, in the order the groups appear."""

GROUP_OF: dict[str, str] = {
    "workload_code_edit_bf16": "workloads",
    "workload_agentic_bf16": "workloads",
    "workload_code_edit_fp32": "workloads",
    "workload_agentic_fp32": "workloads",
    "workload_code_edit_suffix_fp32": "workloads",
    "workload_agentic_suffix_fp32": "workloads",
    "workload_code_edit_concurrency_fp32": "workloads",
    "long_context_fp32": "workloads",
    "suffix_store_memory": "workloads",
    "kv_sized": "workloads",
    "foundation_specbench_bf16": "drafters",
    "foundation_specbench_fp32": "drafters",
    "retrieval_scaling": "drafters",
    "data_scaling_eagle3_bf16": "training",
    "data_scaling_specblock_bf16": "training",
    "eagle3_graft_specbench_bf16": "graft",
    "graft_specbench_fp32": "graft",
    "graft_humaneval_fp32": "graft",
    "graft_asdiv_fp32": "graft",
    "sweep_graft_heldout_fp32": "graft",
    "specblock_specbench_bf16": "specblock",
    "specblock_giveup_bf16": "specblock",
    "specblock_grad_terms": "specblock",
    "concurrency_specbench_bf16": "batching",
    "concurrency_specbench_fp32": "batching",
    "concurrency_specbench39_bf16": "batching",
    "concurrency_specbench39_fp32": "batching",
    "concurrency_specbench39_bf16_amx": "batching",
    "concurrency_specbench_fp32_drafting_charged_to_vanilla": "batching",
    "goodput_against_vanilla_bf16": "batching",
    "goodput_against_vanilla_bf16_amx": "batching",
    "goodput_calibration_n8_fp32": "batching",
    "goodput_calibration_n16_fp32": "batching",
    "payoff_veto_bf16": "batching",
    "batch_invariant_bf16_amx": "batching",
    "fold_prefills_fp32": "batching",
    "chunked_prefill_fp32": "batching",
    "chunked_prefill_c64_fp32": "batching",
    "chunked_prefill_budget_n16_fp32": "batching",
    "serve_load": "serving",
    "fuzz_api": "serving",
    "two_node_serve": "serving",
    "ray_overhead_two_node": "serving",
    "load_locust": "serving",
    "load_locust_chunked_prefill": "serving",
    "load_locust_whole_prefill": "serving",
    "serve_load_threads_1": "serving",
    "serve_load_threads_2": "serving",
    "ray_overhead": "serving",
    "adapt_domain_shift_eagle3_fp32": "adaptation",
    "adapt_domain_shift_eagle3_fp32_cheapest_first": "adaptation",
    "adapt_domain_shift_eagle3_fp32_data_aware": "adaptation",
    "adapt_domain_shift_eagle3_fp32_explore_budget": "adaptation",
    "adapt_domain_shift_eagle3_fp32_paired_guard": "adaptation",
    "adapt_domain_shift_eagle3_fp32_paired_guard_budget20": "adaptation",
    "adapt_domain_shift_eagle3_fp32_recency": "adaptation",
    "adapt_domain_shift_eagle3_fp32_audit": "adaptation",
    "adapt_harmful_eagle3_fp32": "adaptation",
    "adapt_domain_shift_specblock_fp32": "adaptation",
    "adapt_domain_shift_specblock_fp32_horizon600": "adaptation",
    "adapt_harmful_specblock_fp32": "adaptation",
    "online_knobs_eagle3_code_fp32": "adaptation",
    "online_knobs_eagle3_chat_fp32": "adaptation",
    "serve_adaptive_static": "adaptation",
    "serve_adaptive_learner": "adaptation",
    "serve_adaptive_learner_inbox": "adaptation",
    "serve_adaptive_static_pair": "adaptation",
    "serve_adaptive_guarded": "adaptation",
    "verify_curve": "kernels",
    "output_head_fp32": "kernels",
    "linear_kernels_fp32": "kernels",
    "decode_profile_fp32": "kernels",
    "decode_profile_lean_fp32": "kernels",
    "drafter_kernels_fp32": "kernels",
    "cost_correction_fp32": "kernels",
    "single_query_attention_bf16": "kernels",
    "vllm_peers_specbench_bf16": "peers",
    "vllm_peers_specbench_fp32": "peers",
    "concurrency_vllm_specbench_fp32": "peers",
}
"""Result stem -> its group. A result missing here is an error (``report`` names it)."""

ARCHIVE_OF: dict[str, str] = {
    "concurrency_specbench_fp32_drafting_charged_to_vanilla": "concurrency_specbench_fp32",
    "serve_adaptive_learner": "serve_adaptive_learner_inbox",
    "load_locust_chunked_prefill": "load_locust",
}
"""Superseded result stem -> the run that superseded it. Conservative: only runs whose own title or
note says they measured code since fixed (drafting charged to vanilla before the goodput fix; the
learner's rounds inside ``feed`` before the inbox, which dropped 78% of the feedback), or a
setting that became the default and was measured again as such (chunked prefill in
``serve_local.yaml``)."""


def _load(stem: str) -> dict:
    return json.loads((RESULTS / f"{stem}.json").read_text())


def _x(v: float, d: int = 2) -> str:
    return fmt(v, d, "×")


@dataclass(frozen=True)
class Claim:
    """One row of the verdict table (and, where ``headline``, of README's headline table)."""

    stem: str
    question: str
    target: str
    measured: Callable[[dict], str]
    headline: str | None = None
    """README's wording of the claim (``{host}``: the JSON's machine), or None to keep it out of the headline."""
    label: str | None = None
    """A short name for the link to the section (else the section's title)."""


def _host(res: dict) -> str:
    """The machine of one result, short: the CPU family its ``env.cpu`` names, and its bf16 ISA."""
    env = res.get("env", {})
    cpu = env.get("cpu", "?")
    isa = f" with {env['cpu_isa']}" if env.get("cpu_isa") else ""  # recorded since 2026-12-06
    for family in ("Xeon", "EPYC"):
        if family in cpu:
            return f"{'Intel' if family == 'Xeon' else 'AMD'} {family}{isa}"
    return cpu + isa


def _load_ramp(r: dict) -> str:
    t = r["targets"]
    if not t.get("evaluated"):
        return "not evaluated"
    return (f"{t['users']} users: {t['server_errors']} 5xx, {t['lost']} lost, p99 ITL {fmt(t['itl_p99_ratio'], 2)}x "
            f"unloaded ({'met' if t['met'] else 'missed'})")


def _fuzz(r: dict) -> str:
    return (f"{r['cases']} cases: {r['server_errors']} 5xx, {len(r['failures'])} failed checks, "
            f"healthy after: {'yes' if r['healthy_after'] else 'no'}")


def _foundation(r: dict) -> str:
    m, p = r["methods"]["retrieval"], r.get("peers", {})
    lossless = ("token-identical to vanilla on all " f"{r['n_turns']} turns" if m["lossless"] is True
                else f"match rate {fmt(m['lossless'])} over {r['n_turns']} turns")
    out = (f"{_x(m['speedup'])} ({fmt(m['tokens_per_s'], 1)} against {fmt(r['baseline_tokens_per_s'], 1)} tok/s), "
           f"tau {fmt(m['tau'])}, {lossless}")
    if "hf_prompt_lookup" in p:
        out += f"; HF prompt lookup {_x(p['hf_prompt_lookup']['speedup'])}"
    return out


def _eagle3_budgets(r: dict) -> str:
    ms = r["methods"]
    names = [n for n in ms if re.fullmatch(r"eagle3_\d+", n)]
    return (" / ".join(_x(ms[n]["speedup"]) for n in names) + " vanilla at "
            + " / ".join(n.split("_")[1] for n in names) + " tokens, tau "
            + " / ".join(fmt(ms[n]["tau"]) for n in names))


def _graft_bf16(r: dict) -> str:
    ms = r["methods"]
    g, d, ro = ms["graft"], ms["eagle3_32"], ms["retrieval_only"]
    return (f"Graft {_x(g['speedup'])} against dense EAGLE-3 {_x(d['speedup'])} ({_x(g['speedup'] / d['speedup'])} "
            f"the dense speedup), tau {fmt(g['tau'])} against {fmt(d['tau'])}; retrieval_only {_x(ro['speedup'])}")


def _graft_vs_retrieval(r: dict) -> str:
    ms = r["methods"]
    best = max((n for n in ms if n.startswith("graft")), key=lambda n: ms[n]["speedup"])
    lossless = all(m.get("lossless") is True for m in ms.values())
    gate = (ms[best].get("drafter_stats") or {}).get("gate_call")
    steps = ms[best].get("steps")
    return (f"best Graft arm `{best}` {_x(ms[best]['speedup'])} vanilla against retrieval "
            f"{_x(ms['retrieval']['speedup'])} ({_x(ms[best]['speedup'] / ms['retrieval']['speedup'])})"
            + (f"; the gate calls the drafter in {round(gate * steps)} of {steps} steps" if gate and steps else "")
            + ("; every arm lossless" if lossless else ""))


def _sweep(r: dict) -> str:
    b = r["best"]
    return (f"best trial {b['trial_number']}: {_x(b['sweep'].get('speedup'))} on the sweep's categories, "
            f"{_x(b['holdout'].get('speedup'))} on the held-out ones")


def _specblock(r: dict) -> str:
    ms = r["methods"]
    s, e = ms["specblock"], ms["eagle3_48"]
    return (f"{_x(s['speedup'])} against {_x(e['speedup'])} vanilla at 48 tokens ({_x(s['speedup'] / e['speedup'])} "
            f"of EAGLE-3); drafting {fmt(1000 * s['drafting_s_per_step'], 1)} against "
            f"{fmt(1000 * e['drafting_s_per_step'], 1)} ms per step")


def _vanilla_scaling(r: dict) -> str:
    c = r["concurrency"]
    base = c["1"]["methods"]["vanilla"]["tokens_per_s"]
    ns = [n for n in c if n != "1"]
    return (", ".join(_x(c[n]["methods"]["vanilla"]["tokens_per_s"] / base) for n in ns)
            + f" its N = 1 throughput at N = {' / '.join(ns)}")


def _paired(r: dict) -> str:
    c = r["concurrency"]
    first, second = list(next(iter(c.values()))["arms"])
    return (f"{first} / {second} " + ", ".join(f"{_x(lv['ratio_median'])} at N = {n}" for n, lv in c.items())
            + f" (medians of {len(next(iter(c.values()))['ratio_tokens_per_s_paired'])} pairs)")


def _vllm_solo(r: dict) -> str:
    ms, p = r["methods"], r["peers"]
    return (f"our vanilla {_x(ms['vanilla']['tokens_per_s'] / p['vllm']['tokens_per_s'])} vLLM; retrieval "
            f"{_x(ms['retrieval']['tokens_per_s'] / p['vllm_ngram']['tokens_per_s'])} vLLM's n-gram; our retrieval "
            f"inside vLLM {_x(p['vllm_retrieval']['tokens_per_s'] / p['vllm_ngram']['tokens_per_s'])} n-gram")


def _vllm_load(r: dict) -> str:
    c = r["concurrency"]
    return "vLLM / ours, batched vanilla: " + ", ".join(
        f"{_x(lv['peers']['vllm']['tokens_per_s'] / lv['methods']['vanilla']['tokens_per_s'])} at N = {n}"
        for n, lv in c.items())


def _serving(r: dict) -> str:
    return (f"serving / offline throughput {fmt(r['serving_over_offline'])} at {r['clients']} streaming clients, "
            f"{r['errors']} errors in {r['requests_done']} requests")


def _harmful(r: dict) -> str:
    h = r["harmful"]
    lossless = all(p["lossless"] is True for p in r["policies"].values())
    return (f"{h['closed_as'].replace('_', ' ')} {h['requests_to_rollback']} request(s) after the swap (counting its own); "
            f"cost {fmt(100 * h['cost_share_of_phase'], 2)}% of the phase's serving time"
            + ("; output unchanged" if lossless else ""))


def _learner(r: dict) -> str:
    p = r["policies"]
    ca = p["cost_aware"]
    kept = [d for d in ca.get("decisions", []) if d.get("outcome") == "kept"]
    realised = (f" (realised {fmt(kept[0]['realised_gain_s'], 1)} s)" if kept and kept[0].get("realised_gain_s")
                is not None else "")
    return (f"{ca['updates']} update(s) applied, {len(kept)} kept{realised}, {ca['rollbacks']} rolled back, "
            f"{ca['gated']} gated; {_x(ca['tokens_per_s'] / p['static']['tokens_per_s'], 3)} static over the run")


def _serve_learner(r: dict) -> str:
    lrn = r.get("learner") or {}
    return (f"feedback sent {int(lrn.get('feedback_sent', 0))}, dropped {int(lrn.get('feedback_dropped', 0))}; "
            f"swaps {int(lrn.get('swaps', 0))}, rollbacks {int(lrn.get('rollbacks', 0))}; "
            f"{fmt(r['output_tokens_per_s'], 2)} tok/s, {r['errors']} errors")


def _decode_lean(r: dict) -> str:
    b = r.get("baseline") or {}
    return (f"{fmt(r['wall_ms_per_step'], 1)} ms per step; {_x(b.get('paired_speedup_median'), 3)} the baseline "
            f"`{b.get('name', '?')}` (median of pairs), identical tokens: {fmt(b.get('identical_tokens'))}")


def _linear_kernels(r: dict) -> str:
    s = r["speedup_vs_linear_vanilla"]
    return ", ".join(f"{arm}: vanilla {_x(per['vanilla'])}" for arm, per in s.items() if arm != "linear") + \
        " against `F.linear` vanilla"


def _workload(r: dict) -> str:
    ms, peers = r["methods"], r.get("peers", {})
    ours = max((n for n in ms if n != "vanilla"), key=lambda n: ms[n]["tokens_per_s"])
    out = ", ".join(f"{n} {_x(ms[n]['speedup'])} (tau {fmt(ms[n]['tau'])})" for n in ms if n != "vanilla")
    rivals = [p for p in ("vllm_ngram", "vllm_suffix") if p in peers and peers[p].get("tokens_per_s")]
    if rivals:
        best = max(rivals, key=lambda p: peers[p]["tokens_per_s"])
        out += (f"; {ours} {_x(ms[ours]['tokens_per_s'] / peers[best]['tokens_per_s'])} vLLM `{best.split('_')[1]}` "
                f"({_x(peers[best]['speedup'])} our vanilla)")
        mine, theirs = ms[ours], peers[best]
        if mine.get("decode_tokens_per_s") and theirs.get("decode_tokens_per_s"):  # vLLM's prefill: its TTFT
            out += (f", decode loop alone {_x(mine['decode_tokens_per_s'] / theirs['decode_tokens_per_s'])}, prefill "
                    f"{fmt(mine['prefill_s'] / mine['n_turns'], 2)} against {fmt(theirs['prefill_s'] / theirs['n_turns'], 2)} s/turn")
    if "hf_prompt_lookup" in peers:
        out += f"; HF prompt lookup {_x(peers['hf_prompt_lookup']['speedup'])}"
    lossless = all(m.get("lossless") is True for m in ms.values())
    out += "; every method lossless" if lossless else ""
    missing = r.get("peers_unavailable") or {}
    return out + (f"; not run here: {', '.join(missing)}" if missing else "")


def _long_context(r: dict) -> str:
    runs = r.get("workloads", {})
    names = [n for n in (next(iter(runs.values()))["methods"] if runs else {}) if n != "vanilla"]
    sizes = " / ".join(k.split("_")[1] for k in runs)
    def one(n: str) -> str:
        out = f"{n} " + " / ".join(_x(w["methods"][n]["speedup"]) for w in runs.values())
        decode = [w["methods"][n].get("decode_speedup") for w in runs.values()]
        if all(d is not None for d in decode):
            out += " (decode loop alone " + " / ".join(_x(d) for d in decode) + ")"
        return out
    return "; ".join(one(n) for n in names) + f" vanilla at {sizes}"


def _data_scaling(r: dict) -> str:
    eq = r.get("equal_tokens") or []
    if not eq:
        return "no common evaluation point"
    last = eq[-1]
    return f"{last['of']}: {_x(last['ratio'])} held-out tau at {last['tokens']:,} training tokens"


def _data_scaling_tau(r: dict) -> str:
    best = max(r["curves"], key=lambda c: c["points"][-1]["tau"] or 0.0)
    reach = best["reach"].get("2.5")
    extra = (f"; its fit reaches 2.5 at ≈ {reach['tokens'] / 1e6:,.0f}M tokens (≈ {reach['cpu_hours']:,.0f} CPU-h)"
             if reach else "")
    return f"{fmt(best['points'][-1]['tau'])} ({best['label']}, {best['tokens']:,} tokens){extra}"


def _kv_sized(r: dict) -> str:
    f, z = r["runs"]["fixed"], r["runs"]["sized"]
    return (f"peak KV {fmt(z['peak_bytes'] / 2**20, 0)} MiB sized vs {fmt(f['peak_bytes'] / 2**20, 0)} MiB fixed "
            f"({fmt(r['peak_memory_ratio'])}×), wall {fmt(r['wall_ratio_sized_over_fixed'])}×, "
            f"tokens identical: {r['identical_tokens']}")


def _store_memory(r: dict) -> str:
    f, b = r["fill"], r["bounded"]
    return (f"{fmt(f['mib_per_million_tokens'], 0)} MiB per million stored tokens; a {b['capacity_tokens']}-token store "
            f"fed {b['fed_tokens']} held {b['stored_tokens']}")


CLAIMS: tuple[Claim, ...] = (
    Claim("workload_code_edit_bf16", "Code editing in bf16, batch 1, against vLLM n-gram and suffix, same run",
          "≥ 2.5× own vanilla, ≥ 1.2× the better of vLLM n-gram / suffix (#41)", _workload,
          "Code editing: retrieval against vanilla and vLLM n-gram / SuffixDecoding, same run (bf16, {host})",
          label="Workload: code_edit (bf16)"),
    Claim("workload_agentic_bf16", "Agent loops in bf16, batch 1, against vLLM n-gram and suffix, same run",
          "≥ 2.5× own vanilla, ≥ 1.2× the better of vLLM n-gram / suffix (#41)", _workload,
          "Agent loops: retrieval against vanilla and vLLM n-gram / SuffixDecoding, same run (bf16, {host})",
          label="Workload: agentic (bf16)"),
    Claim("workload_code_edit_fp32", "Does retrieval pay where the output copies the prompt (code editing)?",
          "≥ 2.5× own vanilla, ≥ 1.2× the best vLLM n-gram/suffix (#41)", _workload,
          label="Workload: code_edit (fp32)"),
    Claim("workload_agentic_fp32", "Does it pay on agent loops (ReAct scratchpads, tool output)?",
          "≥ 2.5× own vanilla, ≥ 1.2× the best vLLM n-gram/suffix (#41)", _workload,
          label="Workload: agentic (fp32)"),
    Claim("workload_code_edit_suffix_fp32", "Code editing against vLLM's SuffixDecoding, same run",
          "≥ 1.2× the better of vLLM n-gram / suffix (#41)", _workload, label="code_edit vs vLLM suffix (fp32)"),
    Claim("workload_agentic_suffix_fp32", "Agent loops against vLLM's SuffixDecoding, same run",
          "≥ 1.2× the better of vLLM n-gram / suffix (#41)", _workload, label="agentic vs vLLM suffix (fp32)"),
    Claim("long_context_fp32", "Does it pay on long documents (2K to 8K prompt tokens)?",
          "≥ 1.5× vanilla at 8K (#41)", _long_context, label="Long context (fp32)"),
    Claim("kv_sized", "Are KV slots sized to the context a request needs?",
          "memory follows the live requests, same tokens (#41)", _kv_sized, label="KV slots sized per request"),
    Claim("suffix_store_memory", "What does the cross-request suffix store cost in memory?",
          "bounded by its token capacity", _store_memory, label="Suffix store memory"),
    Claim("data_scaling_eagle3_bf16", "Does the target's own data train a better drafter than ShareGPT's answers?",
          "self-distilled ≥ 1.2× raw-data held-out tau at equal compute (#38)", _data_scaling,
          label="Training data and scale (EAGLE-3)"),
    Claim("data_scaling_eagle3_bf16", "How far is a held-out tau of 2.2 (EAGLE-3)?", "tau ≥ 2.2 held out (#38)",
          _data_scaling_tau, label="Training data and scale (EAGLE-3)"),
    Claim("data_scaling_specblock_bf16", "Does the target's own data train a better SpecBlock head?",
          "self-distilled ≥ 1.2× raw-data held-out tau at equal compute (#38)", _data_scaling,
          label="Training data and scale (SpecBlock)"),
    Claim("foundation_specbench_bf16", "Does the training-free retrieval drafter beat vanilla?",
          "faster than vanilla and HF prompt lookup", _foundation,
          "Retrieval drafter beats vanilla on Spec-Bench (bf16, {host})", label="Foundation (bf16)"),
    Claim("foundation_specbench_fp32", "Is retrieval lossless and still faster in fp32?",
          "token-identical to vanilla, > 1×", _foundation,
          "Retrieval is lossless and still faster in fp32 ({host})", label="Foundation (fp32)"),
    Claim("eagle3_graft_specbench_bf16", "Does the committed EAGLE-3 head pay on its own?", "> 1× vanilla",
          _eagle3_budgets, "The committed EAGLE-3 head is too weak to pay (bf16, {host})", label="EAGLE-3 and Graft (bf16)"),
    Claim("eagle3_graft_specbench_bf16", "Does Graft rescue the dense EAGLE-3 tree?",
          "Graft ≥ dense EAGLE-3 and ≥ retrieval alone (#11)", _graft_bf16,
          "Graft rescues the dense EAGLE-3 tree, but not past retrieval alone (bf16, {host})", label="EAGLE-3 and Graft (bf16)"),
    Claim("graft_specbench_fp32", "Is Graft priced like its best source (fp32, cost cut)?",
          "Graft ≥ the best single source (#11)", _graft_vs_retrieval,
          "Graft with the cost cut is priced like its best source (fp32, {host})", label="Graft ablation (fp32)"),
    Claim("graft_asdiv_fp32", "Does Graft hold on a dataset not used to build it?",
          "Graft ≥ the best single source (#11)", _graft_vs_retrieval, label="Graft on ASDiv (fp32)"),
    Claim("sweep_graft_heldout_fp32", "Does a swept Graft configuration carry to held-out categories?",
          "held-out speedup near the sweep's", _sweep, label="Graft sweep, held out (fp32)"),
    Claim("specblock_specbench_bf16", "SpecBlock against EAGLE-3 at equal training budget", "≥ EAGLE-3",
          _specblock, "SpecBlock against EAGLE-3 at equal training budget (bf16, {host})", label="SpecBlock (bf16)"),
    Claim("concurrency_specbench39_bf16_amx", "Does batched vanilla scale with concurrency?",
          "≥ 4× at N = 8 (#12)", _vanilla_scaling, "Batched vanilla scales with concurrency (bf16, 39 prompts, {host})", label="Concurrency, AMX-BF16"),
    Claim("goodput_against_vanilla_bf16_amx", "Does speculation pay under load with the goodput rule?",
          "≥ 1× batched vanilla at every N", _paired,
          "Speculation under load with the goodput rule, back to back (bf16, {host})", label="Goodput, AMX-BF16"),
    Claim("vllm_peers_specbench_fp32", "One request at a time, against vLLM", "≈ 1× vLLM", _vllm_solo,
          "One request at a time against vLLM (fp32, {host})", label="vLLM as a peer"),
    Claim("concurrency_vllm_specbench_fp32", "Under load, against vLLM's continuous batching", "≈ 1× vLLM",
          _vllm_load, "Under load against vLLM (fp32, {host})", label="Batching against vLLM"),
    Claim("serve_load", "Does a live server keep the offline engine's throughput?",
          "serving / offline ≥ 0.80", _serving,
          "A live OpenAI-compatible server keeps the offline engine's throughput (fp32, {host})", label="Serving"),
    Claim("load_locust", "Does overload stay clean (2x saturation)?", "0 5xx, none lost, p99 ITL ≤ 3x unloaded",
          _load_ramp, label="Load ramp (locust)"),
    Claim("load_locust_whole_prefill", "... with whole-prompt prefills instead of the default chunks?",
          "0 5xx, none lost, p99 ITL ≤ 3x unloaded", _load_ramp, label="Load ramp, whole-prompt prefill"),
    Claim("fuzz_api", "Does the API survive fuzzing (≥ 1,000 schemathesis cases)?",
          "0 5xx, every 4xx an OpenAI error body, healthy after", _fuzz, label="API fuzzing"),
    Claim("adapt_harmful_eagle3_fp32", "Does the swap guard roll back a harmful update?",
          "rolled back within one watch window, output unchanged", _harmful,
          "The swap guard rolls back a harmful update (EAGLE-3, fp32, {host})", label="Harmful update"),
    Claim("adapt_domain_shift_specblock_fp32_horizon600", "Does cost-aware adaptation apply an update that pays?",
          "≥ static net of update cost", _learner,
          "Cost-aware online adaptation against static (SpecBlock, fp32, {host})", label="600 s horizon"),
    Claim("serve_adaptive_guarded", "Does the learner run inside a live server without dropping feedback?",
          "no feedback dropped, 0 errors", _serve_learner, label="Adaptive serving, guarded"),
    Claim("decode_profile_lean_fp32", "Is the lean decoder loop faster than transformers' forward?",
          "> 1×, identical tokens", _decode_lean, label="Lean decoder loop (fp32)"),
    Claim("linear_kernels_fp32", "Do packed linear kernels speed up vanilla decoding?", "> 1× `F.linear`",
          _linear_kernels, label="Linear kernels (fp32)"),
)


# --- anchors and layout ------------------------------------------------------------------------


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _date(res: dict) -> str:
    return res.get("env", {}).get("date", "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def result_files() -> list[Path]:
    """Every result JSON, each checked for a renderer and a group (a clear error naming the file)."""
    files = sorted(RESULTS.glob("*.json"))
    for path in files:
        kind_of(json.loads(path.read_text()), path)
        if path.stem not in GROUP_OF:
            raise render.UnknownKind(f"{path.relative_to(ROOT)}: no group in benchmarks/report.py GROUP_OF "
                                     f"(one of: {', '.join(GROUPS)})")
    return files


def _verdicts(link: Callable[[str], str]) -> list[str]:
    lines = ["## Verdicts", "",
             "Each row's figure is read from the JSON of the section it links to (`benchmarks/report.py`, `CLAIMS`).",
             "", "| question | target | measured | date | command | section |", "|---|---|---|---|---|---|"]
    for c in CLAIMS:
        res = _load(c.stem)
        path = RESULTS / f"{c.stem}.json"
        lines.append(f"| {_cell(c.question)} | {_cell(c.target)} | {_cell(c.measured(res))} | {_date(res)[:10]} | "
                     f"`{_cell(command_of(res, path))}` | [{_cell(c.label or title_of(path))}]({link(c.stem)}) |")
    return lines


def _ordered(files: list[Path]) -> dict[str, list[Path]]:
    """Group -> its live (not archived) results, newest first."""
    out: dict[str, list[Path]] = {g: [] for g in GROUPS}
    for path in files:
        if path.stem not in ARCHIVE_OF:
            out[GROUP_OF[path.stem]].append(path)
    for paths in out.values():
        paths.sort(key=lambda p: (_date(json.loads(p.read_text())), p.stem), reverse=True)
    return {g: ps for g, ps in out.items() if ps}


def benchmarks_md(files: list[Path]) -> str:
    groups = _ordered(files)
    out = [render.HEADER, "Superseded runs are in [benchmarks/archive.md](benchmarks/archive.md).", ""]
    out += _verdicts(lambda stem: f"#{anchor(title_of(RESULTS / f'{stem}.json'))}") + [""]
    out += ["## Contents", ""]
    for g, paths in groups.items():
        out.append(f"- [{GROUPS[g]}](#{anchor(GROUPS[g])})")
        for p in paths:
            out.append(f"  - [{title_of(p)}](#{anchor(title_of(p))})")
    out.append("")
    for g, paths in groups.items():
        out += [f"## {GROUPS[g]}", ""]
        for p in paths:
            out += render.section(p, level=3)
    return "\n".join(out).rstrip("\n") + "\n"


def archive_md(files: list[Path]) -> str:
    archived = sorted((p for p in files if p.stem in ARCHIVE_OF),
                      key=lambda p: (_date(json.loads(p.read_text())), p.stem), reverse=True)
    out = ["# Benchmarks archive", "",
           "Generated by `graftblock report`; do not edit. Superseded runs, kept for the record: each measured code "
           "that has since been fixed or replaced. The current tables are in [BENCHMARKS.md](../BENCHMARKS.md).", ""]
    for p in archived:
        newer = RESULTS / f"{ARCHIVE_OF[p.stem]}.json"
        body = render.section(p, level=2)
        body = [line.replace("](benchmarks/", "](") for line in body]  # links relative to benchmarks/
        out += body[:2] + [f"Superseded by [{title_of(newer)}](../BENCHMARKS.md#{anchor(title_of(newer))}).", ""] \
            + body[2:]
    return "\n".join(out).rstrip("\n") + "\n"


def headline(files: list[Path]) -> str:
    """README's headline table (between the markers), one row per ``Claim`` with a headline."""
    lines = ["| claim | measured | link |", "|---|---|---|"]
    for c in CLAIMS:
        if c.headline is None:
            continue
        res = _load(c.stem)
        title = title_of(RESULTS / f"{c.stem}.json")
        lines.append(f"| {_cell(c.headline.format(host=_host(res)))} | {_cell(c.measured(res))} | "
                     f"[{_cell(c.label or title)}](BENCHMARKS.md#{anchor(title)}) |")
    return "\n".join(lines)


def readme_with_headline(readme: str, table: str) -> str:
    try:
        head, rest = readme.split(HEADLINE_BEGIN, 1)
        _, tail = rest.split(HEADLINE_END, 1)
    except ValueError:
        raise ValueError(f"README.md lacks the {HEADLINE_BEGIN} / {HEADLINE_END} markers") from None
    return f"{head}{HEADLINE_BEGIN}\n{table}\n{HEADLINE_END}{tail}"


def generate() -> dict[Path, str]:
    """Every generated file's expected text."""
    files = result_files()
    return {BENCHMARKS: benchmarks_md(files), ARCHIVE: archive_md(files),
            README: readme_with_headline(README.read_text(), headline(files))}


def stale() -> list[Path]:
    """The generated files whose committed text differs from what ``generate`` gives."""
    return [p for p, text in generate().items() if not p.exists() or p.read_text() != text]


def _name(p: Path) -> str:
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each generated file that differs from its sources")


def run(args: argparse.Namespace) -> int:
    expected = generate()
    if args.check:
        bad = [p for p, text in expected.items() if not p.exists() or p.read_text() != text]
        if bad:
            names = ", ".join(_name(p) for p in bad)
            print(f"graftblock report: stale: {names} differ from benchmarks/results/*.json and "
                  f"benchmarks/notes/*.md; run `graftblock report` and commit the result", file=sys.stderr)
            return 1
        print("graftblock report: BENCHMARKS.md, benchmarks/archive.md and README's headline are up to date")
        return 0
    for p, text in expected.items():
        p.write_text(text)
    n = len(result_files())
    print(f"wrote {', '.join(_name(p) for p in expected)} ({n} result files, "
          f"{len(ARCHIVE_OF)} archived)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graftblock report", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
