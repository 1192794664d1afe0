"""The bench harness: every method and peer on the same prompts, interleaved, in one run.

For each question, every method (vanilla first in the list, then the others, the order rotated
per question so no method always runs right after another) answers all turns; a second turn is
conditioned on that method's own first answer, as Spec-Bench does. Greedy outputs are compared
with vanilla's turn by turn. Results follow the JSON contract in docs/architecture.md §5.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from speculation import assets
from speculation.bench import vllm_peers
from speculation.bench.metrics import MethodRuns, TurnRun, summarize_with_speedup
from speculation.bench.peers import Peer, available_peers, parse_peers, peer_stats, reset_peer_stats, run_hf_batched, run_peer
from speculation.config import BatchConfig, BenchConfig, ConfigError, EngineConfig, SamplingConfig, to_dict
from speculation.drafters import (
    Drafter,
    DrafterType,
    MethodSpec,
    Reportable,
    build_drafter,
    drafter_factory,
    resolve_methods,
)
from speculation.engine.batch import BatchEngine, Request
from speculation.engine.sequence import GenerationResult, TargetBackend
from speculation.engine.solo import generate_speculative, generate_vanilla
from speculation.model.prefix_cache import PrefixCache, PrefixCacheConfig, PrefixCachedTarget, PrefixCacheStats
from speculation.model.target import TargetModel
from speculation.spec.step import DraftingCheck

BASELINE = "vanilla"

MethodParts = Callable[[MethodSpec], tuple[TargetBackend[Any], Drafter]]
"""Supplies a method's target backend and a fresh drafter (see :func:`run_bench`); e.g.
``cluster.deploy.RayDeployment.method_parts``."""


def emit_json(result: dict, path: Path | None) -> None:
    """Print a benchmark script's result and write it to ``path`` when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if path is not None:
        path.write_text(text)


def median_call_s(fn: Callable[[], Any], calls: int = 60, warmup: int = 10) -> float:
    """Median wall seconds of ``fn()`` over ``calls`` calls, the first ``warmup`` not counted."""
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bf16_isa(flags: set[str]) -> str | None:
    """The widest bf16-capable vector ISA in ``flags`` (``/proc/cpuinfo``): where bf16 runs natively
    (AMX, AVX-512 BF16) and where it is emulated (AVX-512, AVX2); None when unknown."""
    for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"),
                       ("avx2", "AVX2")):
        if flag in flags:
            return name
    return None


def environment() -> dict:
    """Machine and software facts recorded with every result."""
    cpu = platform.processor()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == platform.processor():
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": cpu,
        "cpu_isa": _bf16_isa(flags),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": commit,
    }


def _goodput_verdicts(steps: list) -> dict[str, float] | None:
    """Share of sequence steps per goodput verdict before drafting (:class:`DraftingCheck`'s
    values), from the step records' stats; None without the goodput rule. A vetoed step also
    carries ``goodput_drafting_skipped``, so the flags are read VETO first."""
    ruled = [s for s in steps if "goodput_drafting_skipped" in s.stats]
    if not ruled:
        return None
    counts = dict.fromkeys((c.value for c in DraftingCheck), 0)
    for s in ruled:
        st = s.stats
        kind = (DraftingCheck.VETO if st.get("goodput_drafting_vetoed")
                else DraftingCheck.RETEST if st.get("goodput_drafting_retest")
                else DraftingCheck.PROBE if st.get("goodput_drafting_probe")
                else DraftingCheck.SKIP if st["goodput_drafting_skipped"] else DraftingCheck.DRAFT)
        counts[kind.value] += 1
    return {k: v / len(ruled) for k, v in counts.items()}


class _Runner:
    """Runs one method (or peer) on turns, keeping per-method conversation histories."""

    def __init__(self, name: str, target: TargetModel, engine: EngineConfig,
                 spec: MethodSpec | None = None, peer: Peer | None = None,
                 method_parts: MethodParts | None = None, prefix_cache: PrefixCacheConfig | None = None) -> None:
        self.name = name
        self.target = target
        self.engine = engine
        self.spec = spec
        self.peer = peer
        self.method_parts = method_parts
        # Each method keeps its own conversations, so each gets its own prompt cache: what a server
        # serving those conversations would hold (peers keep their own: vLLM's prefix caching).
        self.cached: PrefixCachedTarget | None = (
            PrefixCachedTarget(target, PrefixCache(prefix_cache)) if prefix_cache is not None and peer is None else None)
        self.backend: TargetBackend[Any] = self.cached if self.cached is not None else target
        self.drafter = self.build()

    def build(self) -> Drafter | None:
        """A fresh drafter (None for vanilla and peers); ``method_parts`` also picks the backend."""
        if self.spec is None:
            return None
        if self.method_parts is not None and self.spec.type != DrafterType.VANILLA:
            self.backend, drafter = self.method_parts(self.spec)
            return drafter
        return build_drafter(self.spec, self.target)

    def generate(self, prompt_ids: list[int]) -> GenerationResult:
        if self.peer is not None:
            return run_peer(self.peer, self.target, prompt_ids, self.engine.max_new_tokens, self.engine.sampling)
        if self.drafter is None:
            return generate_vanilla(self.backend, prompt_ids, self.engine)
        return generate_speculative(self.backend, self.drafter, prompt_ids, self.engine)


def run_bench(
    cfg: BenchConfig,
    target: TargetModel,
    questions: list[assets.Question],
    method_configs: dict | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    method_parts: MethodParts | None = None,
    prefill_chunk_tokens: int | None = None,
    prefix_cache: PrefixCacheConfig | None = None,
) -> dict:
    """Run the bench and return the result dict (the bench contract, docs/architecture.md §5).

    ``prefill_chunk_tokens``: every method's prompt is prefilled in forwards of at most this many
    tokens (``EngineConfig.prefill_chunk_tokens``; long documents), None = one forward.
    ``prefix_cache``: each method (vanilla included) reuses the prompt rows of its own earlier
    turns (:mod:`speculation.model.prefix_cache`; its grid must be ``prefill_chunk_tokens``), as
    vLLM's peers do with their automatic prefix caching. Not with ``method_parts``.

    ``method_parts(spec) -> (backend, drafter)``, when given, supplies every non-vanilla
    method's target backend and a fresh drafter (e.g. Ray actors); vanilla and peers still run
    on the in-process ``target``, the baseline.
    """
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    names = list(cfg.methods)
    if BASELINE not in names:
        names.insert(0, BASELINE)
    specs = resolve_methods(names, method_configs)
    if prefix_cache is not None:
        if prefix_cache.chunk_tokens != prefill_chunk_tokens:
            raise ConfigError(f"prefix_cache reuses rows on a {prefix_cache.chunk_tokens}-token prefill grid: "
                              f"prefill_chunk_tokens must be {prefix_cache.chunk_tokens}, got {prefill_chunk_tokens}")
        if method_parts is not None:
            raise ConfigError("prefix_cache runs on the in-process target only: drop it with Ray backends")
    peers, peers_unavailable = available_peers(parse_peers(",".join(cfg.peers)))
    engine = EngineConfig(max_new_tokens=cfg.max_new_tokens, sampling=cfg.sampling,
                          prefill_chunk_tokens=prefill_chunk_tokens)
    tok = target.tokenizer
    runners = [_Runner(s.name, target, engine, spec=s, method_parts=method_parts, prefix_cache=prefix_cache)
               for s in specs]
    runners += [_Runner(p.value, target, engine, peer=p) for p in peers]
    results = {r.name: MethodRuns(r.name) for r in runners}

    if cfg.warmup and questions:
        # Full-length warm-up on the first question: the first generations at new shapes pay
        # one-off kernel selection costs (oneDNN/AMX), which would otherwise land on whichever
        # method happens to run first.
        warm_ids = assets.encode_turn(tok, [], questions[0].turns[0])
        for r in runners:
            for _ in range(cfg.warmup):
                r.generate(warm_ids)
        # Drafters start measured runs from a fresh state: warm-up must not leak retrieval data
        # (nor prompt rows: the first measured turn must not find its prompt cached).
        for r in runners:
            if r.spec is not None:
                r.drafter = r.build()
            if r.cached is not None:
                r.cached.cache.clear()
                r.cached.cache.stats = PrefixCacheStats()
        reset_peer_stats()

    for qi, q in enumerate(questions):
        turns = q.turns[: cfg.max_turns] if cfg.max_turns else q.turns
        order = runners[qi % len(runners):] + runners[: qi % len(runners)]
        per_method: dict[str, list[GenerationResult]] = {}
        for r in order:
            history: list[tuple[str, str]] = []
            outs = []
            for user in turns:
                ids = assets.encode_turn(tok, history, user)
                res = r.generate(ids)
                outs.append(res)
                history.append((user, tok.decode(res.tokens, skip_special_tokens=True)))
            per_method[r.name] = outs
        base = per_method[BASELINE]
        for name, outs in per_method.items():
            for ti, res in enumerate(outs):
                match = None if not cfg.sampling.greedy or name == BASELINE else res.tokens == base[ti].tokens
                results[name].runs.append(TurnRun(q.question_id, q.category, ti, res, match))
        if progress is not None:
            progress(qi + 1, len(questions), q.category)

    baseline = results[BASELINE]
    out = {
        "model": cfg.model,
        "dtype": cfg.dtype.value,
        "dataset": cfg.dataset,
        "n_prompts": len(questions),
        "n_turns": len(baseline.runs),
        "categories": sorted({q.category for q in questions}),
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.sampling.temperature,
        "sampling": to_dict(cfg.sampling),
        "prefill_chunk_tokens": prefill_chunk_tokens,
        "prefix_cache": None if prefix_cache is None else to_dict(prefix_cache),
        "env": environment(),
        "bench_config": to_dict(cfg),
        "methods": {},
        "peers": {},
    }
    if peers_unavailable:
        out["peers_unavailable"] = peers_unavailable
    base_summary = summarize_with_speedup(baseline, baseline)
    out["baseline_tokens_per_s"] = base_summary["tokens_per_s"]
    for r in runners:
        summary = summarize_with_speedup(results[r.name], baseline)
        if r.peer is not None:
            summary["lossless"] = _lossless(summary, cfg)
            summary["config"] = {"peer": r.peer.value}
            for key in ("tau", "mean_tree_size", "drafting_share", "drafter_forwards_per_step", "drafting_s_per_step"):
                summary[key] = None  # HF's loops do not expose their steps
            summary.update(peer_stats(r.peer))  # vLLM peers: vllm_acceptance_length
            out["peers"][r.name] = summary
            continue
        summary["lossless"] = True if r.name == BASELINE else _lossless(summary, cfg)
        if r.cached is not None:
            summary["prefix_cache"] = r.cached.cache.stats.as_dict()
        summary["config"] = {"type": r.spec.type.value, **r.spec.config_dict()}
        if isinstance(r.drafter, Reportable) and (report := r.drafter.report()):
            summary["drafter_report"] = report  # e.g. Graft's chosen dense budget and why; the suffix store's counters
        out["methods"][r.name] = summary
    return out


def _lossless(summary: dict, cfg: BenchConfig) -> bool | float | None:
    """True if every turn matched vanilla token for token, else the match rate; None if sampled."""
    rate = summary.get("match_rate")
    if rate is None or not cfg.sampling.greedy:
        return None
    return True if rate == 1.0 else rate



# ---------------------------------------------------------------------------- --concurrency
def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return float(torch.quantile(torch.tensor(xs, dtype=torch.float64), q))


def run_concurrency(
    cfg: BenchConfig,
    target: TargetModel,
    questions: list[assets.Question],
    levels: list[int],
    method_configs: dict | None = None,
    goodput: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
    fold_prefills: bool = True,
    refs: list[list[int]] | None = None,
    prefill_chunk_tokens: int | None = None,
    prefill_step_tokens: int | None = None,
    payoff_veto: bool = False,
    prefix_cache: PrefixCacheConfig | None = None,
) -> dict:
    """Closed-loop clients over :class:`~speculation.engine.batch.BatchEngine`, per concurrency N and method.

    N clients each send one first turn, and send the next prompt of the dataset as soon as their
    request ends (the engine admits it at the next step), until every prompt is answered. Per N and
    method: ``tokens_per_s`` (all output tokens / wall seconds), ``request_tokens_per_s`` (mean of
    each request's tokens / its seconds from add to finish), TTFT and inter-token latency p50/p99
    and the longest gap (a step that emits k tokens counts k gaps of its duration / k), ``tau`` (mean tokens gained per
    verify step), ``speedup`` (÷ batched vanilla at the same N), ``saturated_tokens_per_s`` and
    ``saturated_speedup`` (the same over the window while every client is busy: :func:`_saturated`)
    and ``lossless`` (greedy: every
    request equals its solo vanilla output; else the match rate; None when sampling), plus the
    mean tree tokens granted per sequence step (the budget split). On CUDA, timestamps are taken
    after ``torch.cuda.synchronize``. ``progress(done, total, "N=<n> <method>")`` is called as each
    request finishes. ``fold_prefills``: ``BatchConfig.fold_prefills`` (arriving prompts prefilled
    inside the step's forward; False is the A/B baseline). ``prefill_chunk_tokens``:
    ``BatchConfig.prefill_chunk_tokens`` (chunked prefill; the solo references then chunk alike),
    ``prefill_step_tokens``: its per-step budget. ``payoff_veto``: ``BatchConfig.payoff_veto``
    (with ``goodput``; False is the A/B baseline). ``prefix_cache``: each engine (per N and
    method) gets a fresh :class:`~speculation.model.prefix_cache.PrefixCache` shared by all its
    sequences (needs ``prefill_chunk_tokens`` equal to its grid); its counters are in the method's row.
    ``refs``: the solo vanilla outputs of the first turns when already known (greedy), else
    computed here.
    """
    names = list(cfg.methods)
    if BASELINE not in names:
        names.insert(0, BASELINE)
    specs = resolve_methods(names, method_configs)
    tok = target.tokenizer
    prompts = [assets.encode_turn(tok, [], q.turns[0]) for q in questions]
    engine_cfg = EngineConfig(max_new_tokens=cfg.max_new_tokens, sampling=cfg.sampling,
                              prefill_chunk_tokens=prefill_chunk_tokens)
    if refs is None and cfg.sampling.greedy:
        refs = [generate_vanilla(target, p, engine_cfg).tokens for p in prompts]
    elif not cfg.sampling.greedy:
        refs = None
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    slot_len = max(len(p) for p in prompts) + cfg.max_new_tokens + 1
    out: dict[str, Any] = {}
    done, n_requests = 0, len(levels) * len(specs) * len(prompts)
    for n in levels:
        methods: dict[str, dict] = {}
        for spec in specs:
            # One-time set-up outside the timed loop: the c(T) a cost-aware drafter measures, and a
            # fresh cross-request store per level (a level's requests never see another level's outputs).
            factory = drafter_factory(spec, target)
            engine = BatchEngine(target, factory, BatchConfig(max_sequences=n, max_tokens_per_sequence=slot_len,
                                                              goodput=goodput, fold_prefills=fold_prefills,
                                                              prefill_chunk_tokens=prefill_chunk_tokens,
                                                              prefill_step_tokens=prefill_step_tokens,
                                                              payoff_veto=payoff_veto),
                                 prefix_cache=None if prefix_cache is None else PrefixCache(prefix_cache))
            added: dict[str, float] = {}
            last: dict[str, float] = {}
            ttft: list[float] = []
            itl: list[float] = []
            req_rates: list[float] = []
            tokens: dict[str, list[int]] = {}
            steps = []
            nxt = 0

            def send(now: float) -> None:
                nonlocal nxt
                i = nxt
                nxt += 1
                s = cfg.sampling
                sampling = SamplingConfig(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed + i)
                engine.add(Request(f"q{i}", prompts[i], cfg.max_new_tokens, sampling))
                added[f"q{i}"] = now
                tokens[f"q{i}"] = []

            sync()
            t0 = time.perf_counter()
            while nxt < min(n, len(prompts)):
                send(t0)
            # the saturated window: from the start until the first client finds no next prompt
            # (every client busy throughout; None when the dataset has fewer prompts than clients)
            dry_s: float | None = None
            window_tokens, ran_dry = 0, False
            while engine.has_work():
                ups = engine.step()
                sync()
                now = time.perf_counter()
                for u in ups:
                    if u.new_tokens:
                        if not tokens[u.request_id]:
                            ttft.append(now - added[u.request_id])
                        else:
                            gap = (now - last[u.request_id]) / len(u.new_tokens)
                            itl.extend([gap] * len(u.new_tokens))
                        last[u.request_id] = now
                        tokens[u.request_id].extend(u.new_tokens)
                        if dry_s is None:
                            window_tokens += len(u.new_tokens)
                    if u.step is not None:
                        steps.append(u.step)
                    if u.finished is not None:
                        req_rates.append(len(tokens[u.request_id]) / max(now - added[u.request_id], 1e-9))
                        done += 1
                        if progress is not None:
                            progress(done, n_requests, f"N={n} {spec.name}")
                        if nxt < len(prompts):
                            send(now)
                        elif len(prompts) >= n:
                            ran_dry = True
                if ran_dry and dry_s is None:  # the whole step's tokens count: they share its timestamp
                    dry_s = now - t0
            wall = time.perf_counter() - t0
            total = sum(len(v) for v in tokens.values())
            spec_steps = [s for s in steps if s.tree_size > 0]
            m = {
                "tokens_per_s": total / wall,
                "request_tokens_per_s": sum(req_rates) / len(req_rates),
                "ttft_p50_s": _percentile(ttft, 0.5),
                "ttft_p99_s": _percentile(ttft, 0.99),
                "itl_p50_s": _percentile(itl, 0.5),
                "itl_p99_s": _percentile(itl, 0.99),
                "itl_max_s": max(itl) if itl else None,
                "tau": sum(s.tokens_gained for s in spec_steps) / len(spec_steps) if spec_steps else None,
                "mean_tree_tokens_per_seq_step": (sum(s.tree_size for s in spec_steps) / len(spec_steps)
                                                  if spec_steps else None),
                "steps": engine.steps_run,
                "wall_s": wall,
                **_saturated(window_tokens, dry_s, wall),
            }
            verdicts = _goodput_verdicts(spec_steps)
            if verdicts is not None:
                m["goodput_verdicts"] = verdicts
            if engine.prefix_cache is not None:
                m["prefix_cache"] = engine.prefix_cache.stats.as_dict()
            if refs is None:
                m["lossless"] = None
            else:
                m["lossless"] = _match_refs([tokens[f"q{i}"] for i in range(len(prompts))], refs)
            methods[spec.name] = m
        base = methods[BASELINE]["tokens_per_s"]
        base_saturated = methods[BASELINE]["saturated_tokens_per_s"]
        for m in methods.values():
            m["speedup"] = m["tokens_per_s"] / base
            m["saturated_speedup"] = (m["saturated_tokens_per_s"] / base_saturated
                                      if m["saturated_tokens_per_s"] is not None and base_saturated else None)
        level: dict[str, Any] = {"methods": methods, "fold_prefills": fold_prefills, "payoff_veto": payoff_veto,
                                 "prefill_chunk_tokens": prefill_chunk_tokens, "prefill_step_tokens": prefill_step_tokens,
                                 "prefix_cache": None if prefix_cache is None else to_dict(prefix_cache)}
        peer_rows: dict[str, dict] = {}
        runnable, peers_unavailable = available_peers(parse_peers(",".join(cfg.peers)))
        if peers_unavailable:
            level["peers_unavailable"] = peers_unavailable
        for peer in runnable:
            if peer == Peer.HF_GENERATE:
                peer_rows[peer.value] = _hf_batched_row(cfg, target, prompts, refs, n)
            elif peer.value in vllm_peers.PEER_METHODS:
                peer_rows[peer.value] = _vllm_closed_loop_row(peer.value, cfg, target, prompts, refs, n)
        for row in peer_rows.values():
            row["speedup"] = row["tokens_per_s"] / base
        if peer_rows:
            level["peers"] = peer_rows
        out[str(n)] = level
    return out


def _saturated(window_tokens: int, dry_s: float | None, wall_s: float) -> dict[str, float | None]:
    """The closed loop's saturated window: from the start (all N clients sending) until the first
    client finds the dataset exhausted. Its throughput, ``saturated_tokens_per_s`` = tokens emitted
    in the window / the window's seconds, is the engine at a steady N; ``tokens_per_s`` also counts
    the drain, where fewer than N requests are left (a small dataset at a large N is mostly drain).
    The window includes the opening prefills of all N prompts, so it does not flatter prefill.
    Between two arms it is biased against the one whose requests end at staggered steps: at the
    window's end such an arm has N requests in flight whose prefills the window paid and whose
    tokens it counts only in part, while arms whose requests end in lockstep (batched vanilla,
    equal lengths) close the window on a wave boundary. So read it for one arm's scaling with N;
    compare arms on ``tokens_per_s``.
    ``saturated_share``: the window's share of the run's wall time. None when the dataset has fewer
    prompts than clients (N is never reached)."""
    if dry_s is None or dry_s <= 0.0:
        return {"saturated_tokens_per_s": None, "saturated_wall_s": None, "saturated_share": None}
    return {"saturated_tokens_per_s": window_tokens / dry_s, "saturated_wall_s": dry_s,
            "saturated_share": dry_s / wall_s}


def _match_refs(outputs: list[list[int]], refs: list[list[int]]) -> bool | float:
    """True when every output equals its reference (solo vanilla), else the share that does."""
    matches = [t == r for t, r in zip(outputs, refs)]
    return True if all(matches) else sum(matches) / len(matches)


def _vllm_closed_loop_row(peer: str, cfg: BenchConfig, target: TargetModel, prompts: list[list[int]],
                          refs: list[list[int]] | None, n: int) -> dict:
    """A vLLM peer under the same closed loop as our methods: ``n`` clients, each sending the next
    prompt as its request finishes, on vLLM's own engine loop (its continuous batching). The same
    figures as a method row, plus vLLM's mean acceptance length."""
    run = vllm_peers.session_for(peer, target).closed_loop(prompts, cfg.max_new_tokens, cfg.sampling, n)
    total = sum(len(t) for t in run.tokens)
    ttft = [f - a for f, a in zip(run.first_token_s, run.added_s) if f is not None]
    rates = [len(t) / max(f - a, 1e-9) for t, f, a in zip(run.tokens, run.finished_s, run.added_s)]
    row: dict[str, Any] = {
        "tokens_per_s": total / run.wall_s,
        "request_tokens_per_s": sum(rates) / len(rates),
        "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p99_s": _percentile(ttft, 0.99),
        "itl_p50_s": _percentile(run.itl_s, 0.5), "itl_p99_s": _percentile(run.itl_s, 0.99),
        "wall_s": run.wall_s,
        "vllm_acceptance_length": 1.0 + run.accepted / run.drafts if run.drafts else None,
    }
    if refs is None:
        row["lossless"] = None
    else:
        row["lossless"] = _match_refs(run.tokens, refs)
    return row


def _hf_batched_row(cfg: BenchConfig, target: TargetModel, prompts: list[list[int]],
                    refs: list[list[int]] | None, n: int) -> dict:
    """HF ``generate`` with left padding, ``n`` prompts per call (static batches, in dataset order).

    ``tokens_per_s`` = all output tokens / summed batch walls; ``request_tokens_per_s`` = mean over
    requests of tokens / its batch's wall (a request returns when its batch does). HF's call is
    not streamed, so TTFT and inter-token latency are not observable (None).
    """
    tokens: list[list[int]] = []
    wall = 0.0
    req_rates: list[float] = []
    for i in range(0, len(prompts), n):
        run = run_hf_batched(target, prompts[i:i + n], cfg.max_new_tokens, cfg.sampling)
        wall += run.wall_s
        tokens += run.tokens
        req_rates += [len(t) / max(run.wall_s, 1e-9) for t in run.tokens]
    row: dict[str, Any] = {
        "tokens_per_s": sum(len(t) for t in tokens) / wall,
        "request_tokens_per_s": sum(req_rates) / len(req_rates),
        "ttft_p50_s": None, "ttft_p99_s": None, "itl_p50_s": None, "itl_p99_s": None,
        "tau": None, "mean_tree_tokens_per_seq_step": None, "wall_s": wall,
    }
    if refs is None:
        row["lossless"] = None
    else:
        row["lossless"] = _match_refs(tokens, refs)
    return row
