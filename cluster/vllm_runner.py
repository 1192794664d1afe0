"""vLLM engine behind a JSON-lines pipe, for the bench peers and tests (imports vLLM; runs in .venv-vllm).

    .venv-vllm/bin/python -m cluster.vllm_runner '<VllmSpec JSON>'

Protocol: :mod:`speculation.bench.vllm_peers`. One request at a time; each answer carries the
generated token ids, the wall time of vLLM's ``generate`` call, and the deltas of vLLM's
speculative-decoding counters over that call. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before vLLM is imported) so the custom proposer
lives here too; vLLM's own logging is sent to stderr so that stdout carries the protocol only.
"""

from __future__ import annotations

import json
import os
import sys
import time

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


def main(argv: list[str]) -> int:
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from speculation.bench.vllm_peers import VllmSpec

    spec = VllmSpec.from_json(argv[0])
    llm = LLM(
        model=spec.model, dtype=spec.dtype, max_model_len=spec.max_model_len, seed=spec.seed,
        speculative_config=spec.speculative_config(), disable_log_stats=False, enforce_eager=True,
    )
    protocol.write(json.dumps({"ready": vllm.__version__}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        s = request["sampling"]
        greedy = s["temperature"] <= 1e-5
        params = SamplingParams(
            max_tokens=request["max_new_tokens"],
            temperature=0.0 if greedy else s["temperature"],
            top_p=1.0 if greedy else s["top_p"],
            top_k=0 if greedy else s["top_k"],
            seed=None if greedy else s["seed"],
            detokenize=False,
        )
        before = _counters(llm)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=request["prompt"])], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = _counters(llm)
        answer = {"tokens": list(out[0].outputs[0].token_ids), "wall_s": wall}
        answer.update({k: after[k] - before[k] for k in COUNTERS.values()})
        protocol.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
