"""The registry and the shared pieces of the renderers: paths, titles, the section layout, formatting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


VERDICTS = ("draft", "probe", "retest", "skip", "veto")
"""The goodput rule's verdicts before drafting (``DraftingCheck`` values), in the order the tables show them."""


ROOT = Path(__file__).resolve().parent.parent.parent


RESULTS = ROOT / "benchmarks" / "results"


def dataset_label(dataset: str) -> str:
    """A recorded dataset as the tables show it: a name or a path in the repo as recorded; an
    absolute path outside the repo (an early run read Spec-Bench from a shared folder) by its last
    two parts, so no rendered page points outside the repository."""
    path = Path(dataset)
    if not path.is_absolute() or path.is_relative_to(ROOT):
        return dataset
    return f"{path.parent.name}/{path.name}"


def dataset_note(dataset: str) -> str:
    """What a table adds when :func:`dataset_label` shortened an outside path."""
    if dataset_label(dataset) == dataset:
        return ""
    packaged = ("; the same questions now ship in the package as `--dataset spec_bench`"
                if Path(dataset).parent.name == "spec_bench" else "")
    return f" (read from a folder outside the repository when it ran{packaged})"


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


def plots_of(stem: str) -> list[Path]:
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
    "kv_sized": "KV slots sized per request against fixed slots: memory on a long/short mix (fp32)",
    "data_scaling_eagle3_bf16": "EAGLE-3 trained on ShareGPT's answers against the target's own (self-distilled), at equal training tokens (bf16)",
    "data_scaling_specblock_bf16": "SpecBlock trained on ShareGPT's answers against the target's own (self-distilled), at equal training tokens (bf16)",
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
    "fuzz_api": "Serving: the OpenAI API fuzzed from its OpenAPI document (schemathesis)",
    "two_node_serve": "Serving: two Ray nodes against one node with the same CPUs",
    "ray_overhead_two_node": "Ray overhead per step with the shards on two nodes against one node (fp32)",
    "load_locust": "Serving: a locust ramp from 1 to 4x the saturating concurrency (the default config)",
    "load_locust_chunked_prefill": "Serving: the locust ramp with chunked prefill (32-token chunks, 32 prompt tokens per step), before it was the default",
    "load_locust_whole_prefill": "Serving: the locust ramp with whole-prompt prefills (pair of the default-config ramp)",
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


def unavailable(missing: dict[str, str] | None) -> list[str]:
    """The peers asked for but not run on this host, each with the recorded reason."""
    return ["", "Peers asked for but not run here: " + "; ".join(f"`{k}`: {v}" for k, v in missing.items()) + "."] \
        if missing else []


def fmt(v, d: int = 2, suffix: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return f"{v:.{d}f}{suffix}"
    return str(v)


def command_of(res: dict, path: Path) -> str:
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
        f"--dataset {dataset_label(str(cfg.get('dataset')))}",
    ]
    if cfg.get("limit_per_category"):
        parts.append(f"--limit-per-category {cfg['limit_per_category']}")
    parts.append(f"--max-new-tokens {cfg.get('max_new_tokens')}")
    if cfg.get("peers"):
        parts.append(f"--peers {','.join(cfg['peers'])}")
    parts.append(f"--json {path.relative_to(ROOT)}")
    return " ".join(parts)


def env_line(res: dict) -> str:
    env = res.get("env", {})
    return (
        f"Date {env.get('date', '?')}; machine: {env.get('cpu', '?')}"
        f"{', ' + env['cpu_isa'] if env.get('cpu_isa') else ''} ({env.get('cpu_count', '?')} cores, "
        f"{env.get('torch_threads', '?')} torch threads); torch {env.get('torch', '?')}, transformers "
        f"{env.get('transformers', '?')}; commit {env.get('git_commit', '?')}."
    )


def tau_of(m: dict) -> float | None:
    """Tokens per verify step: ours, or a vLLM peer's mean acceptance length (bonus token included)."""
    return m.get("tau") if m.get("tau") is not None else m.get("vllm_acceptance_length")


def ms(v) -> str:
    return "–" if v is None else f"{1000 * v:.0f}"


def tau_cell(m: dict) -> str:
    """tau, or a vLLM peer's mean acceptance length marked as such."""
    if m.get("tau") is None and m.get("vllm_acceptance_length") is not None:
        return f"{fmt(m['vllm_acceptance_length'])} (AL)"
    return fmt(m.get("tau"))


WORKLOAD_DATASETS = ("code_edit", "agentic", "longdoc_2k", "longdoc_4k", "longdoc_8k")
"""Datasets whose bench tables also show acceptance per depth (speculation.assets.workloads)."""


def kind_of(res: dict, path: Path) -> str:
    """The renderer key of one result: its ``kind``, or ``bench`` for a ``graftblock bench`` JSON."""
    kind = res.get("kind") or (BENCH_KIND if "methods" in res else None)
    if kind not in RENDERERS:
        raise UnknownKind(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: result kind {kind!r} "
                          f"has no renderer in benchmarks/render/ (known: {', '.join(sorted(RENDERERS))})")
    return kind


def title_of(path: Path) -> str:
    return SECTIONS.get(path.stem, path.stem.replace("_", " "))


def section(path: Path, level: int = 2) -> list[str]:
    """One result's section: heading, command, date and machine, raw link, tables, plots, the note."""
    res = json.loads(path.read_text())
    out = [f"{'#' * level} {title_of(path)}", "", f"`{command_of(res, path)}`", "", env_line(res), "",
           f"Raw results: [`{path.relative_to(ROOT)}`]({path.relative_to(ROOT)}).", ""]
    out += RENDERERS[kind_of(res, path)](res)
    for png in plots_of(path.stem):
        out += ["", f"![{png.stem}]({png.relative_to(ROOT)})"]
    note = NOTES / f"{path.stem}.md"
    if note.exists():
        out += ["", note.read_text().strip()]
    out.append("")
    return out
