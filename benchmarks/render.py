"""The tables of BENCHMARKS.md, rendered from the committed JSON results (figures are never edited by hand).

    graftblock report            # rewrites BENCHMARKS.md, benchmarks/archive.md, README's headline
    graftblock report --check    # exit 1 naming what is stale

Each JSON under ``benchmarks/results/`` becomes one section (``section``): its title (``SECTIONS``),
the command that produced it, the date, the machine, the model and the dtype, all read from the JSON
itself, then the tables of the renderer registered for its ``kind`` (``@renderer``; a ``graftblock
bench`` JSON has no kind and renders as ``bench``), its plots and its hand-written note
(``benchmarks/notes/<stem>.md``). The layout (verdicts, contents, groups, archive) is
``benchmarks/report.py``'s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from adaptation.gain import break_even_horizon_s
from graftblock.adapt import HARMFUL_POLICY, RECOVERY_WINDOW, RECOVERY_WITHIN, recovery_requests

VERDICTS = ("draft", "probe", "retest", "skip", "veto")
"""The goodput rule's verdicts before drafting (``DraftingCheck`` values), in the order the tables show them."""
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NOTES = ROOT / "benchmarks" / "notes"
BENCH_KIND = "bench"
"""The registry key of a ``graftblock bench`` JSON, which has no ``kind`` field (``methods`` instead)."""

RENDERERS: dict[str, Callable[[dict], list[str]]] = {}
"""Result kind (the JSON's ``kind`` field) -> the function that renders its tables (``@renderer``)."""


class UnknownKind(ValueError):
    """A result JSON whose kind no renderer is registered for."""


def renderer(kind: str) -> Callable[[Callable[[dict], list[str]]], Callable[[dict], list[str]]]:
    """Register ``fn`` as the table renderer of results of ``kind``."""
    def register(fn: Callable[[dict], list[str]]) -> Callable[[dict], list[str]]:
        if kind in RENDERERS:
            raise ValueError(f"two renderers for result kind {kind!r}")
        RENDERERS[kind] = fn
        return fn
    return register


def _plots_of(stem: str) -> list[Path]:
    """The PNGs ``<stem>_<plot>.png`` of one result, not those of a longer result stem that starts
    with it (``concurrency_specbench_fp32`` must not show ``concurrency_specbench_fp32_x``'s plots)."""
    longer = [p.stem for p in RESULTS.glob(f"{stem}_*.json")]
    return [png for png in sorted(RESULTS.glob(f"{stem}_*.png"))
            if not any(png.stem.startswith(f"{other}_") for other in longer)]


# file stem -> section title. Commentary lives in benchmarks/notes/<stem>.md, written by people;
# the tables come from the JSON only.
SECTIONS: dict[str, str] = {
    "workload_code_edit_bf16": "Workload code_edit in bf16 against vLLM's n-gram and SuffixDecoding, prefix cache on (bf16)",
    "workload_agentic_bf16": "Workload agentic in bf16 against vLLM's n-gram and SuffixDecoding, prefix cache on (bf16)",
    "workload_code_edit_fp32": "Workload code_edit: rewriting a pasted function (fp32)",
    "workload_code_edit_suffix_fp32": "Workload code_edit against vLLM's n-gram and SuffixDecoding (fp32)",
    "workload_agentic_suffix_fp32": "Workload agentic against vLLM's n-gram and SuffixDecoding (fp32)",
    "workload_agentic_fp32": "Workload agentic: ReAct transcripts with JSON tool calls (fp32)",
    "workload_code_edit_concurrency_fp32": "Workload code_edit under load: N = 1 and 8 with the goodput rule (fp32)",
    "long_context_fp32": "Long context: c(T, L) to 8K and the longdoc workloads (fp32)",
    "suffix_store_memory": "Cross-request suffix store: memory per million tokens",
    "foundation_specbench_bf16": "Foundation: retrieval drafter vs vanilla and Hugging Face peers (bf16)",
    "foundation_specbench_fp32": "Foundation: retrieval drafter vs vanilla and Hugging Face peers (fp32)",
    "eagle3_graft_specbench_bf16": "EAGLE-3 tree budgets and the Graft ablation (bf16)",
    "graft_specbench_fp32": "Graft ablation (fp32)",
    "graft_humaneval_fp32": "Graft ablation on HumanEval (fp32)",
    "graft_asdiv_fp32": "Graft ablation on ASDiv, a dataset not used while building Graft (fp32)",
    "adapt_domain_shift_eagle3_fp32": "Online adaptation: policies on the domain-shift stream, EAGLE-3 (fp32)",
    "adapt_domain_shift_eagle3_fp32_cheapest_first": "Online adaptation: cost-aware with cheapest-first exploration against static, EAGLE-3 (fp32)",
    "adapt_domain_shift_eagle3_fp32_data_aware": "Online adaptation: cost-aware with a data floor and re-tries as the buffer grows, against static, 40 requests per phase, EAGLE-3 (fp32)",
    "adapt_domain_shift_eagle3_fp32_explore_budget": "Online adaptation: cost-aware with an exploration budget of 10% of serving time, against static, 20 requests per phase, EAGLE-3 (fp32)",
    "adapt_domain_shift_eagle3_fp32_paired_guard": "Online adaptation: each policy on its own serving clock, replays priced, paired swap guard; exploration budget 10%, 20 requests per phase, EAGLE-3 (fp32)",
    "adapt_domain_shift_eagle3_fp32_paired_guard_budget20": "Online adaptation: the same with an exploration budget of 20% (fp32)",
    "adapt_domain_shift_eagle3_fp32_recency": "Online adaptation: 20% exploration budget, recency-weighted training (half-life 8 requests), step-cost probe; the first update kept by the paired guard (fp32)",
    "adapt_domain_shift_eagle3_fp32_audit": "Online adaptation: the recency run's settings with audits of kept updates, on a slower host: nothing applied, so nothing audited (fp32)",
    "adapt_harmful_eagle3_fp32": "Online adaptation: a deliberately harmful update (the draft head's rows shuffled) against static, and the swap guard's rollback, EAGLE-3 (fp32)",
    "adapt_domain_shift_specblock_fp32": "Online adaptation: policies on the domain-shift stream, SpecBlock, 10 requests per phase (fp32)",
    "adapt_domain_shift_specblock_fp32_horizon600": "Online adaptation: SpecBlock, cost-aware against static with a 600 s horizon, 20 requests per phase: the gate applies a code update (fp32)",
    "adapt_harmful_specblock_fp32": "Online adaptation: a deliberately harmful update against static, and the swap guard's rollback, SpecBlock (fp32)",
    "online_knobs_eagle3_code_fp32": "Online updates: learning rate, share of accepted positions, optimizer steps, on HumanEval feedback (EAGLE-3, fp32)",
    "online_knobs_eagle3_chat_fp32": "Online updates: how much feedback a candidate needs, on chat feedback (EAGLE-3, fp32)",
    "sweep_graft_heldout_fp32": "Graft over SpecBlock: Optuna sweep on 4 Spec-Bench categories, best configuration on the 9 held out (fp32)",
    "specblock_specbench_bf16": "SpecBlock against EAGLE-3, and its ablations (bf16)",
    "specblock_giveup_bf16": "SpecBlock: the rank head's give-up class stops a branch (widths 2/4/6/0 against 2/4/6/4, bf16)",
    "specblock_grad_terms": "SpecBlock training: per-slot gradient norms with and without the valid-prefix mask",
    "verify_curve": "Verify cost curve c(T)",
    "ray_overhead": "Ray actor path: per-step overhead of sharding",
    "retrieval_scaling": "Retrieval proposal cost against context length",
    "vllm_peers_specbench_bf16": "vLLM as a peer: vanilla, n-gram, our EAGLE-3 head and our retrieval proposer inside vLLM (bf16)",
    "vllm_peers_specbench_fp32": "vLLM as a peer: vanilla, n-gram, our EAGLE-3 head and our retrieval proposer inside vLLM (fp32)",
    "concurrency_vllm_specbench_fp32": "Continuous batching against vLLM's: the same closed loop on both engines (fp32)",
    "concurrency_specbench_bf16": "Continuous batching: closed-loop concurrency (bf16)",
    "concurrency_specbench_fp32": "Continuous batching: closed-loop concurrency (fp32)",
    "concurrency_specbench39_bf16": "Continuous batching: closed-loop concurrency over 39 prompts, with the saturated window (bf16)",
    "concurrency_specbench39_fp32": "Continuous batching: closed-loop concurrency over 39 prompts, with the saturated window (fp32)",
    "goodput_against_vanilla_bf16": "Goodput rule: retrieval against batched vanilla, back to back, 39 prompts (bf16)",
    "concurrency_specbench39_bf16_amx": "Continuous batching: closed-loop concurrency over 39 prompts on the Xeon host with AMX-BF16 (bf16)",
    "goodput_against_vanilla_bf16_amx": "Goodput rule: retrieval against batched vanilla, back to back, 39 prompts, on the Xeon host with AMX-BF16 (bf16)",
    "payoff_veto_bf16": "Goodput rule: the realised-payoff veto against the rule's predictions alone, side by side (retrieval, bf16)",
    "batch_invariant_bf16_amx": "Batch-invariant mode: products in row groups within the kernels' invariant limit, against the default, kernel and closed loop, on the Xeon host with AMX-BF16 (vanilla, bf16)",
    "single_query_attention_bf16": "Single-query attention in bf16: the half-precision SDPA call against the same call widened to fp32, kernel and closed loop (vanilla, bf16)",
    "fold_prefills_fp32": "Continuous batching: arriving prompts prefilled inside the step's forward against a forward of their own (fp32)",
    "chunked_prefill_fp32": "Continuous batching: chunked prefill (128-token chunks) against whole-prompt prefill (retrieval, goodput rule, fp32)",
    "chunked_prefill_c64_fp32": "Continuous batching: chunked prefill (64-token chunks) against whole-prompt prefill (retrieval, goodput rule, fp32)",
    "chunked_prefill_budget_n16_fp32": "Continuous batching: chunked prefill with a per-step prompt budget against whole prompts, an arrival wave at N = 16 (vanilla, fp32)",
    "concurrency_specbench_fp32_drafting_charged_to_vanilla": "Continuous batching (fp32), the same run before the goodput fix: drafting seconds charged to the vanilla split too",
    "serve_load": "Serving: a live `graftblock serve` under concurrent streaming clients",
    "serve_load_threads_1": "Serving: replica torch threads, 1 (80 requests; pair of the next table)",
    "serve_load_threads_2": "Serving: replica torch threads, 2 (80 requests; pair of the previous table)",
    "serve_adaptive_static": "Adaptive serving, baseline: EAGLE-3 on the domain-shift stream with the learner static (2 streaming clients, fp32)",
    "serve_adaptive_learner": "Adaptive serving, learner on, rounds inside the learner's feed call (before the inbox; 2 clients, fp32)",
    "serve_adaptive_learner_inbox": "Adaptive serving, learner on, rounds in the learner's background thread (2 clients, fp32)",
    "serve_adaptive_static_pair": "Adaptive serving, baseline re-run: learner off (pair of the next table; 2 clients, fp32)",
    "serve_adaptive_guarded": "Adaptive serving, learner on with the paired swap guard, recency-weighted training, a 20% exploration budget and audits of kept updates (2 clients, fp32)",
    "goodput_calibration_n8_fp32": "Goodput rule with the gain correction: retrieval against batched vanilla, side by side (N = 8, fp32)",
    "goodput_calibration_n16_fp32": "Goodput rule: predicted against measured step seconds, side by side with batched vanilla (N = 16, fp32)",
    "output_head_fp32": "Target output head: nn.Linear against the transposed head, vanilla decoding side by side (fp32)",
    "linear_kernels_fp32": "Target linear kernels: F.linear, transposed head, oneDNN-packed layers; vanilla and retrieval side by side (fp32)",
    "decode_profile_fp32": "Where a vanilla decode step's time goes: linear kernels, attention, the rest (fp32)",
    "drafter_kernels_fp32": "Drafter networks: F.linear against oneDNN-packed layers, EAGLE-3 and SpecBlock side by side (fp32)",
    "decode_profile_lean_fp32": "The lean decoder loop against transformers' forward on the same weights: a vanilla decode step (fp32)",
    "cost_correction_fp32": "Solo cost-aware retrieval: a c(T) measured on a busy host, frozen against corrected online (fp32)",
}

HEADER = """# Benchmarks

Generated by `graftblock report` from the JSON files in
`benchmarks/results/`; do not edit the tables by hand. Speedups are ratios against our vanilla
loop on the same target object, measured in the same run, interleaved prompt by prompt (these
machines are shared and noisy: compare ratios, not absolute tokens/s across tables).
Definitions (Spec-Bench): speedup = mean per-question tokens/s ÷ vanilla's; tau = mean tokens
per verify step (bonus included); draft share = drafting seconds ÷ wall seconds; tree = tokens
verified per step; lossless = every turn token-identical to vanilla (else the match rate).
Within a group the newest run comes first. The notes were written in run order, so "the table
above" or "the previous run" in a note means an earlier run, which now sits further down.
"""


def _unavailable(missing: dict[str, str] | None) -> list[str]:
    """The peers asked for but not run on this host, each with the recorded reason."""
    return ["", "Peers asked for but not run here: " + "; ".join(f"`{k}`: {v}" for k, v in missing.items()) + "."] \
        if missing else []


def _f(v, d: int = 2, suffix: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return f"{v:.{d}f}{suffix}"
    return str(v)


def _command(res: dict, path: Path) -> str:
    if res.get("command"):
        return res["command"]
    cfg = res.get("bench_config", {})
    if res.get("kind") == "verify_curve":
        return f"graftblock bench --verify-curve --model {res['model']} --json {path.relative_to(ROOT)}"
    parts = [
        "graftblock bench",
        f"--methods {','.join(cfg.get('methods', []))}",
        f"--model {cfg.get('model')}",
        f"--dtype {cfg.get('dtype')}",
        f"--dataset {cfg.get('dataset')}",
    ]
    if cfg.get("limit_per_category"):
        parts.append(f"--limit-per-category {cfg['limit_per_category']}")
    parts.append(f"--max-new-tokens {cfg.get('max_new_tokens')}")
    if cfg.get("peers"):
        parts.append(f"--peers {','.join(cfg['peers'])}")
    parts.append(f"--json {path.relative_to(ROOT)}")
    return " ".join(parts)


def _env_line(res: dict) -> str:
    env = res.get("env", {})
    return (
        f"Date {env.get('date', '?')}; machine: {env.get('cpu', '?')}"
        f"{', ' + env['cpu_isa'] if env.get('cpu_isa') else ''} ({env.get('cpu_count', '?')} cores, "
        f"{env.get('torch_threads', '?')} torch threads); torch {env.get('torch', '?')}, transformers "
        f"{env.get('transformers', '?')}; commit {env.get('git_commit', '?')}."
    )


def render_bench(res: dict) -> list[str]:
    lines = [
        f"Model **{res['model']}**, dtype **{res['dtype']}**, dataset `{res['dataset']}`: {res['n_prompts']} questions "
        f"({res['n_turns']} turns), {res['max_new_tokens']} new tokens per turn, temperature {res['temperature']}. "
        f"Vanilla: {_f(res['baseline_tokens_per_s'], 1)} tok/s.",
        "",
        "| method | tok/s | speedup | tau | tree | draft share | draft ms/step | verify ms/step | drafter fwd/step | lossless |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = list(res["methods"].items()) + [(f"peer: {k}", v) for k, v in res.get("peers", {}).items()]
    for name, m in rows:
        ds = m.get("drafting_s_per_step")
        vs = m.get("verify_s_per_step")
        lines.append(
            f"| {name} | {_f(m['tokens_per_s'], 1)} | {_f(m['speedup'], 2, '×')} | {_f(_tau(m))} | "
            f"{_f(m.get('mean_tree_size'), 1)} | {_f(m.get('drafting_share'), 3)} | "
            f"{_f(ds * 1000 if ds is not None else None)} | {_f(vs * 1000 if vs is not None else None, 1)} | "
            f"{_f(m.get('drafter_forwards_per_step'), 1)} | {_f(m.get('lossless'))} |"
        )
    lines += _unavailable(res.get("peers_unavailable"))
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
                cells.append(_f(pc["speedup"], 2, "×"))
            else:
                cells.append(f"{_f(pc['speedup'], 2, '×')} ({_f(pc['tau'])})")
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
        shares = [f"{name} {_f(m['prefix_cache']['reused_share'], 2)}" for name, m in rows if "prefix_cache" in m]
        line += (f" Prefix cache on (`--prefix-cache`, {pc['max_tokens']} rows per method): each method reuses "
                 "the prompt rows of its own earlier turns, as vLLM's automatic prefix caching does for the vLLM "
                 f"peers; share of prompt tokens reused: {', '.join(shares)}.")
    prefill = [f"{name} {_f(m['prefill_s'] / m['n_turns'], 2)}" for name, m in rows
               if m.get("prefill_s") and m.get("n_turns")]
    if prefill:
        line += f" Prefill seconds per turn: {', '.join(prefill)} (HF peers report none; a vLLM peer's is its time to first token)."
    return ["", line]


def _tau(m: dict) -> float | None:
    """Tokens per verify step: ours, or a vLLM peer's mean acceptance length (bonus token included)."""
    return m.get("tau") if m.get("tau") is not None else m.get("vllm_acceptance_length")


def _ms(v) -> str:
    return "–" if v is None else f"{1000 * v:.0f}"


def _tau_cell(m: dict) -> str:
    """tau, or a vLLM peer's mean acceptance length marked as such."""
    if m.get("tau") is None and m.get("vllm_acceptance_length") is not None:
        return f"{_f(m['vllm_acceptance_length'])} (AL)"
    return _f(m.get("tau"))


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
            sat = (f"{_f(m.get('saturated_tokens_per_s'), 1)} | {_f(m.get('saturated_speedup'), 2, '×')} | "
                   f"{_f(m.get('saturated_share'), 2)} | " if saturated else "")
            lines.append(
                f"| {n} | {name} | {_f(m['tokens_per_s'], 1)} | {_f(m['speedup'], 2, '×')} | {sat}"
                f"{_f(m['request_tokens_per_s'], 1)} | {_ms(m['ttft_p50_s'])} / {_ms(m['ttft_p99_s'])} | "
                f"{_ms(m['itl_p50_s'])} / {_ms(m['itl_p99_s'])} | {_tau_cell(m)} | "
                f"{_f(m.get('mean_tree_tokens_per_seq_step'), 1)} | {_f(m.get('lossless'))} |")
    lines += _unavailable(next((lv["peers_unavailable"] for lv in res["concurrency"].values()
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


@renderer("serve_load")
def render_serve_load(res: dict) -> list[str]:
    """A live server under N streaming ``openai`` clients, against the offline batched engine."""
    srv = res.get("server", {})
    lines = [f"Server: model **{srv.get('model', res.get('model'))}**, dtype **{srv.get('dtype', '?')}**, method "
             f"`{srv.get('method', '?')}`, {srv.get('max_sequences', '?')} sequences per step; {res['clients']} "
             f"closed-loop streaming clients, greedy, {res['max_tokens']} max tokens, dataset `{res['dataset']}`; "
             f"torch threads: replica {res.get('server_torch_threads', '?')}"
             + (f", offline {res['offline'].get('torch_threads', '?')}" if res.get("offline") else "")
             + (f"; learner policy `{srv['learner_policy']}`" if srv.get("learner_policy") else "") + ".", "",
             "| run | requests | errors | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT ms | tau |",
             "|---|---|---|---|---|---|---|---|",
             f"| serving | {res['requests_done']} | {res['errors']} | {_f(res['output_tokens_per_s'], 1)} | "
             f"{_ms(res['ttft_p50_s'])} / {_ms(res['ttft_p99_s'])} | {_ms(res['itl_p50_s'])} / {_ms(res['itl_p99_s'])} | "
             f"{_ms(res.get('tpot_mean_s'))} | {_f(res.get('tau_mean'))} |"]
    off = res.get("offline")
    if off:
        lines.append(f"| offline batched engine ({off['method']}, N={res['clients']}) | {off['n_prompts']} | 0 | "
                     f"{_f(off['tokens_per_s'], 1)} | {_ms(off['ttft_p50_s'])} / {_ms(off['ttft_p99_s'])} | "
                     f"{_ms(off['itl_p50_s'])} / {_ms(off['itl_p99_s'])} | – | {_f(off.get('tau'))} |")
        lines += ["", f"Serving throughput / offline throughput: **{_f(res['serving_over_offline'], 2)}** "
                      f"(target ≥ 0.80)."]
    if res.get("per_phase"):
        lines += ["", "Per phase of the stream (a request counts in its prompt's phase; seconds from the previous "
                      "phase's last finish):", "", "| phase | requests | tokens | tok/s | mean tau |", "|---|---|---|---|---|"]
        for ph, r in res["per_phase"].items():
            lines.append(f"| {ph} | {r['requests']} | {r['tokens']} | {_f(r['tokens_per_s'], 1)} | {_f(r['tau_mean'], 3)} |")
        lrn = res.get("learner") or {}
        dec = ", ".join(f"{k} {int(v)}" for k, v in sorted((lrn.get("decisions") or {}).items())) or "none"
        lines += ["", f"Learner (scraped from `/metrics` at the end): decisions: {dec}; swaps "
                      f"{int(lrn.get('swaps', 0))}, rollbacks {int(lrn.get('rollbacks', 0))}, weights version "
                      f"{int(lrn.get('weights_version', 0))}; feedback records sent {int(lrn.get('feedback_sent', 0))}, "
                      f"dropped {int(lrn.get('feedback_dropped', 0))}."]
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
                     f"{_f(t['seconds'])} | {_f(t['tokens_per_s'], 1)} | {t['steps_drafted']} | {t['steps_probed']} | "
                     f"{_ms(m['step_s'])} | {_ms(m['forward_s'])} | {_ms(pred)} |")
    lines += ["", f"Median step seconds, vanilla / speculative: **{_f(res['median_step_ratio'], 2)}**."]
    return lines


@renderer("cost_correction")
def render_cost_correction(res: dict) -> list[str]:
    """Solo retrieval on a clean c(T), on a disturbed one used as given, and on the disturbed one corrected online."""
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, {res['prompts']} Spec-Bench first turns, "
             f"{res['max_new_tokens']} new tokens, greedy, one request at a time, arms interleaved per prompt; "
             f"the disturbed curve was measured with {res['burners']} busy-loop processes on the cores.", "",
             "| arm | tok/s | speedup | tau | tree tokens | lossless |", "|---|---|---|---|---|---|"]
    for arm, m in res["arms"].items():
        lines.append(f"| {arm} | {_f(m['tokens_per_s'], 1)} | {_f(m['speedup'], 2, '×')} | {_f(m['tau'])} | "
                     f"{_f(m['mean_tree_tokens'], 1)} | {_f(m['lossless'])} |")
    curves = res["curves_s"]
    sizes = sorted({int(k) for c in curves.values() for k in c}, key=int)
    lines += ["", "c(T) in ms at the 256-token reference context (measured, and after the run's corrections):", "",
              "| curve | " + " | ".join(f"T={n}" for n in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for name, c in curves.items():
        lines.append(f"| {name} | " + " | ".join(_ms(c.get(str(n))) for n in sizes) + " |")
    return lines


@renderer("sweep_heldout")
def render_sweep_heldout(res: dict) -> list[str]:
    """A sweep's trials, then its best configuration on the sweep's categories and on held-out ones."""
    b = res["best"]
    cfg = res["bench_config"]
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, method `{res['method']}` with fixed "
             f"`{json.dumps(res['fixed'])}`; study `{res['study']}`, objective {res['objective']}; "
             f"dataset `{cfg['dataset']}`, {cfg['limit_per_category']} questions per category, "
             f"{cfg['max_new_tokens']} new tokens, greedy. Sweep categories: {', '.join(res['sweep_categories'])}; "
             f"held out: {', '.join(res['holdout_categories'])}.", "",
             "| trial | " + " | ".join(res["knobs"]) + " | speedup | tau | tree | drafting share | status |",
             "|---|" + "---|" * (len(res["knobs"]) + 5)]
    for t in res["trials"]:
        m = t["metrics"]
        mark = " (best)" if t["trial_number"] == b["trial_number"] else ""
        lines.append(f"| {t['trial_number']}{mark} | " + " | ".join(_f(t["params"].get(k), 2) if isinstance(t["params"].get(k), float)
                                                                     else str(t["params"].get(k)) for k in res["knobs"])
                     + f" | {_f(m.get('speedup'), 2, '×')} | {_f(m.get('tau'))} | {_f(m.get('mean_tree_size'), 1)} | "
                     f"{_f(m.get('drafting_share'), 3)} | {t['status']} |")
    lines += ["", f"Best trial {b['trial_number']}, on the sweep's categories and on the held-out ones "
              "(each against vanilla on the same prompts in the same run):", "",
              "| prompts | vanilla tok/s | speedup | tau | tree | drafting share | lossless |", "|---|---|---|---|---|---|---|"]
    for name, key in (("sweep categories", "sweep"), ("held-out categories", "holdout")):
        m = b[key]
        lines.append(f"| {name} | {_f(b[f'{key}_vanilla_tokens_per_s'], 1)} | {_f(m.get('speedup'), 2, '×')} | "
                     f"{_f(m.get('tau'))} | {_f(m.get('mean_tree_size'), 1)} | {_f(m.get('drafting_share'), 3)} | "
                     f"{_f(b[f'{key}_lossless'])} |")
    per = {**b["sweep_per_category"], **b["holdout_per_category"]}
    lines += ["", "Speedup (tau) per category, sweep categories first:", "",
              "| " + " | ".join(per) + " |", "|" + "---|" * len(per),
              "| " + " | ".join(f"{_f(v.get('speedup'), 2, '×')} ({_f(v.get('tau'))})" for v in per.values()) + " |"]
    return lines


def _fires_at(gain: dict, cost_s: float | None, horizon_s: float | None) -> str:
    """The break-even horizon H* = H * C / G_lo of a replayed round (``adaptation.gain``), from the
    recorded G_lo, C and H, so results written before the field existed get it too."""
    lo = gain.get("gain_lo_s")
    if lo is None or cost_s is None or horizon_s is None:
        return "–"
    h = break_even_horizon_s(lo, cost_s, horizon_s)
    return "never (G_lo ≤ 0)" if h == float("inf") else _f(h, 0)


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
        lines.append(f"| {name} | {_f(p['tokens_per_s'], 2)} | {_f(ratio, 3, '×')} | {_f(p['tau'], 3)} | {p['updates']} | "
                     f"{back} | {p['gated']} | {_f(p['cost_s'], 1)} | {_f(p.get('regret'), 1)} | "
                     f"{_f(p['lossless'])} |")
    phases = res["phases"]
    lines += ["", "Per phase, tok/s (tau):", "", "| policy | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
    for name, p in pol.items():
        lines.append(f"| {name} | " + " | ".join(f"{_f(p['per_phase'][ph]['tokens_per_s'], 2)} "
                                                 f"({_f(p['per_phase'][ph]['tau'], 2)})" for ph in phases) + " |")
    if len(phases) > 1:
        lines += ["", f"Recovery after each shift: requests into the phase until tau (trailing mean of "
                  f"{RECOVERY_WINDOW}) is within {RECOVERY_WITHIN:.0%} of its phase-end value (1 = no dip; – = never):",
                  "", "| policy | " + " | ".join(phases[1:]) + " |", "|---|" + "---|" * (len(phases) - 1)]
        for name, p in pol.items():
            rec = p.get("recovery_requests") or recovery_requests(p["tau_series"], p["phase_series"])
            lines.append(f"| {name} | " + " | ".join(_f(rec.get(ph), 0) for ph in phases[1:]) + " |")
    for name, p in pol.items():
        rounds = [d for d in p.get("decisions", []) if d.get("outcome") != "skipped"]
        if not rounds or (name == HARMFUL_POLICY and "harmful" in res):  # its swap: the block below
            continue
        if not any(d.get("gain") for d in rounds):  # always / periodic: no estimate, just the spend
            costs = [_cost_total_s(d["cost"]) for d in rounds if d.get("cost")]
            outcomes = sorted({d["outcome"] for d in rounds})
            lines += ["", f"`{name}`: {len(rounds)} of {len(p.get('decisions', []))} rounds trained "
                      f"({', '.join(outcomes)}; arms {sorted({d['arm'] for d in rounds})} steps), priced cost "
                      f"{_f(min(costs), 1)}–{_f(max(costs), 1)} s per round; no gain is estimated by this policy."]
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
                lines.append(f"| {d['round']} | audit | {d['outcome']} | {_f(d.get('tau_replay_prev'), 3)} (start) | "
                             f"{_f(d.get('tau_replay_new'), 3)} (live) | – | {_f(total, 2)} (replay) | – | – |")
                continue
            lines.append(f"| {d['round']} | {d['arm']} | {d['outcome']} | {_f(g.get('tau_old'), 3)} | "
                         f"{_f(g.get('tau_new'), 3)} [{_f(g.get('tau_new_lo'), 3)}, {_f(g.get('tau_new_hi'), 3)}] | "
                         f"{_f(g.get('gain_s'), 2)} [{_f(g.get('gain_lo_s'), 2)}, {_f(g.get('gain_hi_s'), 2)}] | "
                         f"{_f(total, 2)} | {_fires_at(g, total, c.get('horizon_s'))} | "
                         f"{_f(d.get('realised_gain_s'), 2)} |")
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
                   f"watch window's text: previous weights tau {_f(h.get('tau_replay_prev'), 3)}, shuffled head "
                   f"{_f(h.get('tau_replay_new'), 3)}; live tau {_f(h.get('tau_pre'), 3)} in the window before the swap, "
                   f"{_f(h.get('tau_post'), 3)} in the watch window. The guard's replays cost "
                   f"{_f(h.get('guard_replay_s'), 2)} s.")
    return [f"**Deliberately harmful update** (`{HARMFUL_POLICY}`: static, plus the draft head's rows shuffled, "
            f"seed {h.get('seed')}, published before request {h['at_request']} of phase `{h['phase']}`; guard window "
            f"{h['watch_steps']} verify steps, {h.get('guard_mode')}). {verdict}", "",
            "| tokens/s, harmful / static | ratio |", "|---|---|",
            f"| phase `{h['phase']}` | {_f(h['phase_tokens_per_s'], 3, '×')} |",
            f"| the {h['affected_requests']} request(s) from the swap to the guard's verdict | "
            f"{_f(h['affected_tokens_per_s'], 3, '×')} |"] + (
        [f"| the {h['before_swap_requests']} requests of the phase before the swap (same weights in both: noise) | "
         f"{_f(h['before_swap_tokens_per_s'], 3, '×')} |"] if h.get("before_swap_tokens_per_s") is not None else []) + (
        ["", f"The affected request(s) took {_f(h['affected_extra_s'], 2)} s beyond static's same requests: "
             f"**{_f(100 * h['cost_share_of_phase'], 2)}%** of the harmful policy's {_f(h['phase_serving_s'], 1)} s "
             f"serving the phase (read on the swap's own requests, so the phase's request-to-request noise, "
             f"the row above, does not enter)."] if h.get("cost_share_of_phase") is not None else [])


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
            lines.append(f"| {arm} | {method} | {_f(rate, 1)} | {_f(res['speedup_vs_linear_vanilla'][arm][method], 2, '×')} | "
                         f"{_f(res['identical_to_linear_vanilla'][arm][method])} | {_f(h['M=1'] * 1000, 2)} | "
                         f"{_f(h['M=8'] * 1000, 2)} |")
    return lines


@renderer("online_knobs")
def render_online_knobs(res: dict) -> list[str]:
    """Candidate updates over a knob grid: held-out and train replay tau against the live weights."""
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, drafter `{res['drafter']}`; phase `{res['phase']}` of "
             f"`{res['stream']}`: {res['requests']} requests of {res['max_new_tokens']} tokens served greedily "
             f"(live tau {_f(res['live_tau'], 3)}), the last {res['heldout']} held out ({res['heldout_units']} replay "
             f"units of {res['chunk']} positions). Every candidate starts from the live weights.", "",
             "| train requests (positions) | lr | accepted kept | steps | loss | train s | held-out tau: live → candidate [CI] "
             "| train tau: live → candidate |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lo, hi = r["tau_heldout_new_ci"]
        lines.append(f"| {r['train_requests']} ({r['train_positions']}) | {r['lr']:g} | {r['accepted_keep']:g} | {r['steps']} | "
                     f"{_f(r['mean_loss'], 3)} | {_f(r['train_s'], 0)} | {_f(r['tau_heldout_old'], 3)} → "
                     f"**{_f(r['tau_heldout_new'], 3)}** [{_f(lo, 3)}, {_f(hi, 3)}] | {_f(r['tau_train_old'], 3)} → "
                     f"{_f(r['tau_train_new'], 3)} |")
    return lines


@renderer("decode_profile")
def render_decode_profile(res: dict) -> list[str]:
    """A vanilla decode step: wall time, and the profiler's operator self-times grouped."""
    g = res["groups_ms_per_step"]
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, {res['steps']} greedy decode steps after a "
             f"{res['prompt_tokens']}-token prompt. Wall per step without the profiler: "
             f"**{_f(res['wall_ms_per_step'], 1)} ms** (median of {len(res.get('walls_ms', [])) or 3} runs); under the profiler "
             f"{_f(res['profiled_wall_ms_per_step'], 1)} ms.", ""]
    if res.get("lean_forward") is not None:
        lines += [f"Target forward: {'the lean decoder loop' if res['lean_forward'] else 'transformers'} "
                  "(`speculation/model/lean_forward.py`).", ""]
    if res.get("baseline"):
        b = res["baseline"]
        name = b.get("name", "unfused")
        what = ("without grouped projections and fused norms (separate projections, linear layers packed)"
                if name == "unfused" else f"baseline `{name}` ({b['what']})")
        lines += [f"Side by side, run by run: {what} {_f(b['wall_ms_per_step'], 1)} ms per step (median). "
                  f"The target, each run against its neighbour: **{_f(b.get('paired_speedup_median'), 3)}×** "
                  f"as fast (median), faster in {b.get('pairs_faster', '–')} of {b.get('pairs', '–')} pairs; "
                  f"identical tokens: {_f(b['identical_tokens'])}.", ""]
    lines += ["| part of the profiled step | ms per step | share |", "|---|---|---|"]
    wall = res["profiled_wall_ms_per_step"]
    for name in ("linear", "attention", "other operators"):
        lines.append(f"| {name} (operator self time) | {_f(g.get(name, 0.0), 2)} | {_f(100 * g.get(name, 0.0) / wall, 0, '%')} |")
    lines.append(f"| no operator (Python, module calls, profiler) | {_f(res['unaccounted_ms_per_step'], 2)} | "
                 f"{_f(100 * res['unaccounted_ms_per_step'] / wall, 0, '%')} |")
    lines += ["", "| operator | self ms per step | calls per step |", "|---|---|---|"]
    for op in res["top_operators"]:
        lines.append(f"| `{op['op']}` | {_f(op['self_ms_per_step'], 3)} | {_f(op['calls_per_step'], 1)} |")
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
            lines.append(f"| {name} | {what} | {_f(a['drafting_ms_per_step'], 1)} | {_f(a['verify_ms_per_step'], 1)} | "
                         f"{_f(a['tokens_per_s'], 1)} | {_f(a['tau'], 2)} |")
    lines.append("")
    for name, d in res["drafters"].items():
        lines.append(f"- {name}: drafting time, linear / packed per prompt: **{_f(d['drafting_speedup_paired_median'], 2)}×** "
                     f"(median), packed faster on {d['prompts_faster']} of {res['prompts']} prompts; identical tokens: "
                     f"{_f(d['identical_tokens'])}; lossless against vanilla: {_f(d['lossless'])}.")
    return lines


@renderer("output_head")
def render_output_head(res: dict) -> list[str]:
    """Vanilla decoding with each output head, interleaved prompt by prompt."""
    shape = res["head_shape"]
    lines = [f"Model **{res['model']}**, dtype **{res['dtype']}**, {res['prompts']} Spec-Bench first turns x "
             f"{res['repeats']} repeats, {res['max_new_tokens']} new tokens, greedy vanilla; head {shape[0]} x {shape[1]}.",
             "", "| head | tok/s | head product at M = 1, ms |", "|---|---|---|"]
    for name, rate in res["tokens_per_s"].items():
        lines.append(f"| {name} | {_f(rate, 1)} | {_f(res['head_product_s'][name] * 1000, 2)} |")
    lines += ["", f"Transposed / linear: **{_f(res['ratio'], 3)}×**; identical tokens: {_f(res['identical_tokens'])}."]
    return lines


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
        shares = " / ".join(f"{_f(st[f'stage_{s}'], 2)}" for s in stages) if stages else "–"
        asm = st.get("assembly_s")
        lines.append(
            f"| {name} | " + " | ".join(_f(a) for a in acc[:8]) + f" | {_f(share, 2)} | {shares} | "
            f"{_f(st.get('grafted'), 1)} | {_f(st.get('drafter_nodes'), 1)} | {_f(st.get('blocks'), 2)} | "
            f"{_f(asm * 1e6 if asm is not None else None, 0)} |"
        )
    return lines


@renderer("ray_overhead")
def render_ray_overhead(res: dict) -> list[str]:
    lines = [f"Model **{res['model']}**, {len(res['prompts'])} prompts x {res['max_new_tokens']} new tokens, "
             f"{res['threads']} torch threads, OMP_WAIT_POLICY={res.get('omp_wait_policy')}. Milliseconds per "
             "step (in-process vs over Ray actors with 1 and 2 target shards; overhead = Ray - in-process).", "",
             "| dtype | path | decode step | retrieval spec step | verify 8 | verify 32 | exact vs in-process |",
             "|---|---|---|---|---|---|---|"]
    for dt, r in res["results"].items():
        for path, ms in r["per_path_ms"].items():
            over = r.get("overhead_ms", {}).get(path, {})
            cells = []
            for key in ("decode_ms", "spec_step_ms", "verify_8_ms", "verify_32_ms"):
                extra = f" ({over[key]:+.0f})" if key in over else ""
                cells.append(f"{ms[key]:.0f}{extra}")
            exact = r.get("exact_vs_local", {}).get(path, "–" if path == "local" else None)
            lines.append(f"| {dt} | {path} | " + " | ".join(cells) + f" | {_f(exact)} |")
    return lines


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
                     f"({r['evicted_docs']}) | {_f(r['mib_per_million_tokens'], 1)} | {_f(r['add_tokens_per_s'], 0)} | "
                     f"{_f(r['median_us'], 1)} | {_f(r['p90_us'], 1)} | {_f(r['match_rate'])} | "
                     f"{_f(r['mean_match_len'], 1)} |")
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
                lines.append(f"| {name} | {mean_prompt:.0f} | {m_name} | {_f(m['tokens_per_s'], 1)} | "
                             f"{_f(m['speedup'], 2, '×')} | {_f(prefill, 1)} | {_f(m.get('decode_tokens_per_s'), 1)} | "
                             f"{_f(speedup, 2, '×')} | {_f(m['tau'])} | {_f(m.get('mean_tree_size'), 1)} | "
                             f"{_f(1000 * m['drafting_s_per_step'], 1)} | {_f(verify and 1000 * verify, 1)} | "
                             f"{_f(m['lossless'])} |")
    return lines


@renderer("specblock_grad_terms")
def render_grad_terms(res: dict) -> list[str]:
    """Per-slot gradient norms of block 1's weighted slot losses, masked vs unmasked."""
    lines = [f"Checkpoint `{res['checkpoint']}`, {res['batches']} cached training batches.", "",
             "| mode | rows per slot (0..K-1) | gradient norm per slot term | global norm |", "|---|---|---|---|"]
    for mode, m in res["modes"].items():
        rows = " / ".join(_f(r, 0) for r in m["slot_rows"])
        norms = " / ".join(_f(g, 2) for g in m["slot_grad_norm"])
        lines.append(f"| {mode} | {rows} | {norms} | {_f(m['total_grad_norm'], 2)} |")
    return lines


def _paired_cell(level: dict) -> str:
    """An A/B level's paired tokens/s ratios: the median, each repeat's, and how many favoured arm one."""
    ratios = level["ratio_tokens_per_s_paired"]
    return (f"{_f(level['ratio_median'], 2, '×')} median ({', '.join(_f(r, 2) for r in ratios)}); faster in "
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
            lines.append(f"| {n} | {arm} | {_f(m['tokens_per_s'], 1)} | {_ms(m['ttft_p50_s'])} / {_ms(m['ttft_p99_s'])} "
                         f"| {_ms(m['itl_p50_s'])} / {_ms(m['itl_p99_s'])} / {_ms(m.get('itl_max_s'))} | {_f(m['lossless'])} | {cell} |"
                         + shares)
    saturated = [(n, level) for n, level in res["concurrency"].items() if "saturated_ratio_paired" in level]
    if saturated:
        lines += ["", "The saturated window (from the start until the first client finds the dataset exhausted: every "
                      "client busy), per N: medians over repeats and the paired ratio.", "",
                  f"| N | {' | '.join(f'{a} saturated tok/s' for a in names)} | {' / '.join(names)} (paired) |",
                  "|---|" + "---|" * len(names) + "---|"]
        for n, level in saturated:
            ratios = level["saturated_ratio_paired"]
            lines.append(f"| {n} | " + " | ".join(_f(level['arms'][a]['saturated_tokens_per_s'], 1) for a in names)
                         + f" | {_f(level['saturated_ratio_median'], 2, '×')} median "
                           f"({', '.join(_f(r, 2) for r in ratios)}); faster in {sum(r > 1.0 for r in ratios)} "
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
            lossless = ", ".join(_f(x) for x in m["lossless"])
            lines.append(f"| {n} | {arm} | {_f(m['tokens_per_s'], 1)} | {_ms(m['ttft_p50_s'])} "
                         f"| {_ms(m['itl_p50_s'])} / {_ms(m['itl_p99_s'])} | {lossless} | {cell} |")
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
        lines.append(f"| {k['keys']} | {k['half_us']:.0f} | {k['widened_us']:.0f} | {_f(k['ratio'], 2, '×')} |")
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
        lines.append(f"| {k['shape']} | {_f(k['limit'], 0)} | " + " | ".join(
            f"{us['default'][m]:.0f} / {us['invariant'][m]:.0f}" for m in ms) + " |")
    return lines + ["", *_ab_closed_loop(res, "invariant / default")]


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
        lines.append(f"| {name} | {st['docs']} | {st['tokens']} | {st['evicted_docs']} | {_f(st['match_rate'])} | "
                     f"{st['hits']} | {_f(ds.get('store_nodes'), 2)} | {_f(ds.get('store_match_len'), 2)} |")
    return lines


WORKLOAD_DATASETS = ("code_edit", "agentic", "longdoc_2k", "longdoc_4k", "longdoc_8k")
"""Datasets whose bench tables also show acceptance per depth (speculation.assets.workloads)."""


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


def kind_of(res: dict, path: Path) -> str:
    """The renderer key of one result: its ``kind``, or ``bench`` for a ``graftblock bench`` JSON."""
    kind = res.get("kind") or (BENCH_KIND if "methods" in res else None)
    if kind not in RENDERERS:
        raise UnknownKind(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: result kind {kind!r} "
                          f"has no renderer in benchmarks/render.py (known: {', '.join(sorted(RENDERERS))})")
    return kind


def title_of(path: Path) -> str:
    return SECTIONS.get(path.stem, path.stem.replace("_", " "))


def section(path: Path, level: int = 2) -> list[str]:
    """One result's section: heading, command, date and machine, raw link, tables, plots, the note."""
    res = json.loads(path.read_text())
    out = [f"{'#' * level} {title_of(path)}", "", f"`{_command(res, path)}`", "", _env_line(res), "",
           f"Raw results: [`{path.relative_to(ROOT)}`]({path.relative_to(ROOT)}).", ""]
    out += RENDERERS[kind_of(res, path)](res)
    for png in _plots_of(path.stem):
        out += ["", f"![{png.stem}]({png.relative_to(ROOT)})"]
    note = NOTES / f"{path.stem}.md"
    if note.exists():
        out += ["", note.read_text().strip()]
    out.append("")
    return out


def main() -> int:
    """Kept for ``python benchmarks/render.py``: the same as ``graftblock report``."""
    from benchmarks import report  # here, not at the top: report imports this module
    return report.main([])


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
