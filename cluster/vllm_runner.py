"""vLLM engine behind a JSON-lines pipe, for the bench peers and tests (imports vLLM; runs in .venv-vllm).

    .venv-vllm/bin/python -m cluster.vllm_runner '<VllmSpec JSON>'

Protocol: :mod:`speculation.bench.vllm_peers`. One request line at a time. A generation request
is answered with the generated token ids, the wall time of vLLM's ``generate`` call, its
time to the first token (vLLM's request stats; the prefill), and the deltas of vLLM's speculative-decoding counters over that call. A ``closed_loop`` request runs
``concurrency`` clients over vLLM's engine loop (``add_request`` / ``step``): each client sends
the next prompt as soon as its request finishes; the answer carries every request's tokens, its
add, first-token and finish times, the inter-token gaps, the wall time and the counters' deltas.
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before vLLM is
imported) so the custom proposer lives here too; vLLM's own logging is sent to stderr so that stdout carries the protocol only.
"""

from __future__ import annotations

import json
import os
import sys
import time

from speculation.bench.vllm_peers import VllmSpec

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
KV_CACHE_GIB = "1"


def _counters(llm: object) -> dict[str, int]:
    """Totals of vLLM's speculative-decoding counters (0 when the engine has none)."""
    from vllm.v1.metrics.reader import Counter

    out = dict.fromkeys(COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name in COUNTERS:
            out[COUNTERS[metric.name]] += int(metric.value)
    return out


def _first_token_s(output: object) -> float | None:
    """Seconds from the request's arrival to its first token (vLLM's own per-request stats: the
    prefill, prefix-cache hits included, and the first sampling), or None when vLLM kept none."""
    stats = getattr(output, "metrics", None)
    latency = getattr(stats, "first_token_latency", 0.0) if stats is not None else 0.0
    return float(latency) if latency > 0 else None


def _params(s: dict, max_new_tokens: int, seed_offset: int = 0):
    """vLLM ``SamplingParams`` for a :class:`~speculation.config.SamplingConfig` dict (greedy when
    the temperature is 0), streaming cumulative outputs, no detokenisation."""
    from vllm import SamplingParams

    greedy = s["temperature"] <= 1e-5
    return SamplingParams(
        max_tokens=max_new_tokens,
        temperature=0.0 if greedy else s["temperature"],
        top_p=1.0 if greedy else s["top_p"],
        top_k=0 if greedy else s["top_k"],
        seed=None if greedy else s["seed"] + seed_offset,
        detokenize=False,
    )


def _closed_loop(llm: object, job: dict) -> dict:
    """``job["concurrency"]`` closed-loop clients over ``job["prompts"]`` on vLLM's engine loop.

    Times are seconds from the start; a step that brings a request k new tokens counts k gaps of
    (time since its last tokens) / k, as the graftblock concurrency bench does. Request i samples
    with seed ``sampling.seed + i``.
    """
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    prompts, n = job["prompts"], int(job["concurrency"])
    added, first, finished, last = {}, {}, {}, {}
    tokens: dict[int, list[int]] = {}
    gaps: list[float] = []
    nxt = 0
    before = _counters(llm)
    t0 = time.perf_counter()

    def send(now: float) -> None:
        nonlocal nxt
        i, nxt = nxt, nxt + 1
        engine.add_request(f"c{i}", TokensPrompt(prompt_token_ids=prompts[i]),
                           _params(job["sampling"], job["max_new_tokens"], seed_offset=i))
        added[i], tokens[i] = now - t0, []

    while nxt < min(n, len(prompts)):
        send(t0)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            i = int(out.request_id.removeprefix("c").split("-")[0])
            ids = list(out.outputs[0].token_ids)  # cumulative
            new = len(ids) - len(tokens[i])
            if new > 0:
                if not tokens[i]:
                    first[i] = now - t0
                else:
                    gaps.extend([(now - t0 - last[i]) / new] * new)
                last[i] = now - t0
                tokens[i] = ids
            if out.finished:
                finished[i] = now - t0
                if nxt < len(prompts):
                    send(now)
    wall = time.perf_counter() - t0
    after = _counters(llm)
    order = range(len(prompts))
    answer = {"tokens": [tokens[i] for i in order], "added_s": [added[i] for i in order],
              "first_token_s": [first.get(i) for i in order], "finished_s": [finished[i] for i in order],
              "itl_s": gaps, "wall_s": wall}
    answer.update({k: after[k] - before[k] for k in COUNTERS.values()})
    return answer


def main(argv: list[str]) -> int:
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)

    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    spec = VllmSpec.from_json(argv[0])
    llm = LLM(
        model=spec.model, dtype=spec.dtype, max_model_len=spec.max_model_len, seed=spec.seed,
        speculative_config=spec.speculative_config(), disable_log_stats=False, enforce_eager=True,
    )
    protocol.write(json.dumps({"ready": vllm.__version__}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if "closed_loop" in request:
            protocol.write(json.dumps(_closed_loop(llm, request["closed_loop"])) + "\n")
            continue
        params = _params(request["sampling"], request["max_new_tokens"])
        before = _counters(llm)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=request["prompt"])], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = _counters(llm)
        answer = {"tokens": list(out[0].outputs[0].token_ids), "wall_s": wall, "prefill_s": _first_token_s(out[0])}
        answer.update({k: after[k] - before[k] for k in COUNTERS.values()})
        protocol.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
