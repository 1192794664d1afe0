"""Serving: closed-loop load against ``graftblock serve`` and the Ray hop's overhead."""

from __future__ import annotations

from benchmarks.render.base import dataset_label, dataset_note, fmt, ms, renderer


@renderer("serve_load")
def render_serve_load(res: dict) -> list[str]:
    """A live server under N streaming ``openai`` clients, against the offline batched engine."""
    srv = res.get("server", {})
    lines = [f"Server: model **{srv.get('model', res.get('model'))}**, dtype **{srv.get('dtype', '?')}**, method "
             f"`{srv.get('method', '?')}`, {srv.get('max_sequences', '?')} sequences per step; {res['clients']} "
             f"closed-loop streaming clients, greedy, {res['max_tokens']} max tokens, "
             f"dataset `{dataset_label(res['dataset'])}`{dataset_note(res['dataset'])}; "
             f"torch threads: replica {res.get('server_torch_threads', '?')}"
             + (f", offline {res['offline'].get('torch_threads', '?')}" if res.get("offline") else "")
             + (f"; learner policy `{srv['learner_policy']}`" if srv.get("learner_policy") else "") + ".", "",
             "| run | requests | errors | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT ms | tau |",
             "|---|---|---|---|---|---|---|---|",
             f"| serving | {res['requests_done']} | {res['errors']} | {fmt(res['output_tokens_per_s'], 1)} | "
             f"{ms(res['ttft_p50_s'])} / {ms(res['ttft_p99_s'])} | {ms(res['itl_p50_s'])} / {ms(res['itl_p99_s'])} | "
             f"{ms(res.get('tpot_mean_s'))} | {fmt(res.get('tau_mean'))} |"]
    off = res.get("offline")
    if off:
        lines.append(f"| offline batched engine ({off['method']}, N={res['clients']}) | {off['n_prompts']} | 0 | "
                     f"{fmt(off['tokens_per_s'], 1)} | {ms(off['ttft_p50_s'])} / {ms(off['ttft_p99_s'])} | "
                     f"{ms(off['itl_p50_s'])} / {ms(off['itl_p99_s'])} | – | {fmt(off.get('tau'))} |")
        lines += ["", f"Serving throughput / offline throughput: **{fmt(res['serving_over_offline'], 2)}** "
                      f"(target ≥ 0.80)."]
    if res.get("per_phase"):
        lines += ["", "Per phase of the stream (a request counts in its prompt's phase; seconds from the previous "
                      "phase's last finish):", "", "| phase | requests | tokens | tok/s | mean tau |", "|---|---|---|---|---|"]
        for ph, r in res["per_phase"].items():
            lines.append(f"| {ph} | {r['requests']} | {r['tokens']} | {fmt(r['tokens_per_s'], 1)} | {fmt(r['tau_mean'], 3)} |")
        lrn = res.get("learner") or {}
        dec = ", ".join(f"{k} {int(v)}" for k, v in sorted((lrn.get("decisions") or {}).items())) or "none"
        lines += ["", f"Learner (scraped from `/metrics` at the end): decisions: {dec}; swaps "
                      f"{int(lrn.get('swaps', 0))}, rollbacks {int(lrn.get('rollbacks', 0))}, weights version "
                      f"{int(lrn.get('weights_version', 0))}; feedback records sent {int(lrn.get('feedback_sent', 0))}, "
                      f"dropped {int(lrn.get('feedback_dropped', 0))}."]
    return lines


@renderer("fuzz_api")
def render_fuzz_api(res: dict) -> list[str]:
    """A schemathesis run against a live server's OpenAPI document (``benchmarks/fuzz_api.py``)."""
    srv = res.get("server", {})
    lines = [f"Server: model **{srv.get('model', '?')}**, dtype **{srv.get('dtype', '?')}**, method "
             f"`{srv.get('method', '?')}`, max_tokens {srv.get('max_tokens', '?')}; "
             f"{res['examples_per_operation_mode']} hypothesis cases per operation and mode "
             f"({', '.join(res['modes'])}), seed {res['seed']}: **{res['cases']} cases** in {fmt(res['seconds'], 0)} s, "
             f"**{res['server_errors']} 5xx**, {len(res['failures'])} failed checks, "
             f"healthy afterwards: **{'yes' if res['healthy_after'] else 'no'}**.", "",
             "| operation | mode | " + " | ".join(sorted({s for c in res["by_operation"].values() for s in c})) + " |"]
    statuses = sorted({s for c in res["by_operation"].values() for s in c})
    lines.append("|---|---|" + "---|" * len(statuses))
    for key, counts in res["by_operation"].items():
        op, _, mode = key.rpartition(" ")
        lines.append(f"| `{op}` | {mode} | " + " | ".join(str(counts.get(s, 0)) for s in statuses) + " |")
    for f in res["failures"][:10]:
        lines += ["", f"Failed: `{f['operation']}` ({f['mode']}, {f['status']}, ×{f['count']}): {f['check']}"]
    return lines


def _prefill_label(srv: dict) -> str:
    """How the server prefilled arriving prompts (runs before the field was recorded: unknown)."""
    if "prefill_chunk_tokens" not in srv:
        return "prefill as in the command"
    if srv["prefill_chunk_tokens"] is None:
        return "whole-prompt prefill"
    step = srv.get("prefill_step_tokens")
    return (f"chunked prefill ({srv['prefill_chunk_tokens']}-token chunks"
            + (f", {step} prompt tokens per step)" if step else ")"))


@renderer("load_locust")
def render_load_locust(res: dict) -> list[str]:
    """A locust ramp against a live server (``benchmarks/load_locust.py``)."""
    srv = res.get("server", {})
    lines = [f"Server: model **{srv.get('model', '?')}**, dtype **{srv.get('dtype', '?')}**, method "
             f"`{srv.get('method', '?')}`, {srv.get('max_sequences', '?')} sequences per step x "
             f"{srv.get('num_replicas', '?')} replica(s), admission queue {srv.get('max_waiting', '?')}, "
             f"{_prefill_label(srv)}; "
             f"closed-loop streaming chat users (locust {res['locust']}), greedy, {res['max_tokens']} max tokens, "
             f"{fmt(res['stage_seconds'], 0)} s per stage, dataset `{dataset_label(res['dataset'])}`. Saturating "
             f"concurrency S = {res['saturation']}. {res['requests_sent']} requests sent, **{res['lost']} lost**.", "",
             "| users | ok | goodput tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | errors |",
             "|---|---|---|---|---|---|"]
    for st in res["stages"]:
        errors = ", ".join(f"{k}: {v}" for k, v in st["errors"].items()) or "none"
        lines.append(f"| {st['users']} | {st['requests_ok']} | {fmt(st['goodput_tokens_per_s'], 1)} | "
                     f"{ms(st['ttft_p50_s'])} / {ms(st['ttft_p99_s'])} | {ms(st['itl_p50_s'])} / {ms(st['itl_p99_s'])} | "
                     f"{errors} |")
    t = res["targets"]
    if t.get("evaluated"):
        lines += ["", f"At 2S = {t['users']} users: {t['server_errors']} 5xx, {t['lost']} lost, p99 ITL "
                      f"{fmt(t['itl_p99_ratio'], 2)}x its one-user value (target ≤ {fmt(t['itl_target_ratio'], 0)}x): "
                      f"**{'met' if t['met'] else 'missed'}**."]
    return lines


@renderer("two_node_serve")
def render_two_node_serve(res: dict) -> list[str]:
    """Serving on two Ray nodes against one node with the same CPUs (``benchmarks/two_node_serve.py``)."""
    srv = res["server"]
    lines = [f"Server: model **{srv['model']}**, dtype **{srv['dtype']}**, method `{srv['method']}`, "
             f"{srv['replicas']} replicas of 1 CPU, {srv['max_sequences']} sequences per step each; "
             f"dataset `{dataset_label(res['dataset'])}`. Both layouts are `cluster.local_cluster` clusters on "
             "this one machine, run one after the other.", "",
             "| layout | nodes (CPUs) | requests | errors | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for name, r in res["layouts"].items():
        nodes = " + ".join(str(c) for c in [r["nodes"]["head_cpus"], *r["nodes"]["worker_cpus"]])
        lines.append(f"| {name.replace('_', ' ')} | {nodes} | {r['requests_done']} | {r['errors']} | "
                     f"{fmt(r['output_tokens_per_s'], 1)} | {ms(r['ttft_p50_s'])} / {ms(r['ttft_p99_s'])} | "
                     f"{ms(r['itl_p50_s'])} / {ms(r['itl_p99_s'])} |")
    lines += ["", f"Two nodes / one node, output tok/s: **{fmt(res['two_over_one'], 2)}**."]
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
            lines.append(f"| {dt} | {path} | " + " | ".join(cells) + f" | {fmt(exact)} |")
    placed = {p: len(set(n)) for r in res["results"].values() for p, n in r.get("shard_nodes", {}).items()}
    if placed:
        lines += ["", f"Ray cluster of {res.get('ray_nodes', '?')} node(s); distinct nodes under each path's shards: "
                      + ", ".join(f"{p} {n}" for p, n in placed.items()) + "."]
    return lines
