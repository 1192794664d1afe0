"""vLLM as a measured peer: a long-lived ``cluster.vllm_runner`` subprocess in ``.venv-vllm`` per peer.

Peers (``graftblock bench --peers ...``), all on the bench's own target weights and dtype:

* ``vllm``            vLLM without speculation;
* ``vllm_ngram``      vLLM's n-gram speculation (``NGRAM_TOKENS`` tokens, lookup 1..4);
* ``vllm_eagle3``     vLLM's EAGLE-3 with graftblock's committed head, exported to vLLM's format;
* ``vllm_retrieval``  vLLM with graftblock's retrieval drafter as a ``custom_class`` proposer;
* ``vllm_suffix``     vLLM's SuffixDecoding (``method: suffix``, arctic-inference's C++ suffix trees
  over the prompt and earlier responses; ``make vllm-suffix`` tries to build it).

A peer whose Python module does not import in ``.venv-vllm`` (:func:`unavailable`) is left out of
the run and recorded, with the import error, under the result's ``peers_unavailable``.

Protocol (JSON lines): the runner gets a :class:`VllmSpec` on its command line, answers
``{"ready": ...}`` once the engine is up, then one ``{"tokens", "wall_s", "drafts",
"draft_tokens", "accepted"}`` line per request line ``{"prompt", "max_new_tokens", "sampling"}``.
``wall_s`` covers vLLM's ``generate`` call only (no pipe transfer). vLLM's mean acceptance
length over a run is ``1 + accepted / drafts`` (bonus token included, like graftblock's tau).
"""

from __future__ import annotations

import atexit
import enum
import functools
import json
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from speculation.config import ConfigError, DType, SamplingConfig
from speculation.drafters.checkpoint import CHECKPOINT_ROOT, EAGLE3, TargetFingerprint, find_checkpoint
from speculation.drafters.vllm_format import export_vllm_eagle3
from speculation.engine.sequence import GenerationResult
from speculation.model.target import TargetModel

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
RUNNER_MODULE = "cluster.vllm_runner"
NGRAM_TOKENS = 5
NGRAM_LOOKUP = (1, 4)
SPEC_TOKENS = 5
SUFFIX_TREE_DEPTH = 24
"""SuffixDecoding's speculation depth cap (vLLM's ``suffix_decoding_max_tree_depth`` default)."""
MAX_MODEL_LEN = 4096


class VllmMethod(str, enum.Enum):
    """What vLLM speculates with."""

    NONE = "none"
    NGRAM = "ngram"
    EAGLE3 = "eagle3"
    RETRIEVAL = "retrieval"
    SUFFIX = "suffix"


PEER_METHODS = {
    "vllm": VllmMethod.NONE,
    "vllm_ngram": VllmMethod.NGRAM,
    "vllm_eagle3": VllmMethod.EAGLE3,
    "vllm_retrieval": VllmMethod.RETRIEVAL,
    "vllm_suffix": VllmMethod.SUFFIX,
}
"""Bench peer name -> vLLM method."""

REQUIRED_MODULES = {VllmMethod.SUFFIX: "arctic_inference.suffix_decoding"}
"""vLLM method -> the optional module it needs in ``.venv-vllm`` beyond vLLM itself."""

RETRIEVAL_PROPOSER = "cluster.vllm_proposer.RetrievalProposer"


@dataclass(frozen=True)
class VllmSpec:
    """One vLLM engine: target directory, dtype, speculation method and its settings."""

    model: str
    dtype: str
    method: VllmMethod
    num_speculative_tokens: int = SPEC_TOKENS
    draft: str | None = None
    """Exported EAGLE-3 head directory (``eagle3`` only)."""
    max_model_len: int = MAX_MODEL_LEN
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", VllmMethod(self.method))
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ConfigError(f"vllm.num_speculative_tokens must be in [1, 32], got {self.num_speculative_tokens}")
        if (self.method == VllmMethod.EAGLE3) != (self.draft is not None):
            raise ConfigError("vllm.draft: an exported EAGLE-3 directory is required for eagle3 and only for it")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"vllm.dtype must be float32|bfloat16, got {self.dtype!r}")

    def speculative_config(self) -> dict | None:
        """vLLM's ``speculative_config`` for this spec (None: no speculation)."""
        k = self.num_speculative_tokens
        if self.method == VllmMethod.NONE:
            return None
        if self.method == VllmMethod.NGRAM:
            return {"method": "ngram", "num_speculative_tokens": NGRAM_TOKENS,
                    "prompt_lookup_min": NGRAM_LOOKUP[0], "prompt_lookup_max": NGRAM_LOOKUP[1]}
        if self.method == VllmMethod.EAGLE3:
            return {"method": "eagle3", "model": self.draft, "num_speculative_tokens": k}
        if self.method == VllmMethod.SUFFIX:
            return {"method": "suffix", "num_speculative_tokens": SUFFIX_TREE_DEPTH,
                    "suffix_decoding_max_tree_depth": SUFFIX_TREE_DEPTH}
        return {"method": "custom_class", "model": RETRIEVAL_PROPOSER, "num_speculative_tokens": k}

    def to_json(self) -> str:
        d = asdict(self)
        d["method"] = self.method.value
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> "VllmSpec":
        return cls(**json.loads(text))


@dataclass(frozen=True)
class VllmResult:
    """One generation by vLLM and its speculation counters (deltas over this request)."""

    tokens: list[int]
    wall_s: float
    drafts: int
    draft_tokens: int
    accepted: int
    prefill_s: float | None = None
    """Arrival to first token by vLLM's request stats (its prefill), None when it kept none."""


@dataclass(frozen=True)
class VllmClosedLoop:
    """A closed-loop run of vLLM's engine: per request (dataset order) its tokens and its add,
    first-token and finish times (seconds from the start), every inter-token gap, the wall time
    and the speculation counters' deltas over the run."""

    tokens: list[list[int]]
    added_s: list[float]
    first_token_s: list[float | None]
    finished_s: list[float]
    itl_s: list[float]
    wall_s: float
    drafts: int
    draft_tokens: int
    accepted: int


def acceptance_length(results: list[VllmResult]) -> float | None:
    """vLLM's mean acceptance length ``1 + sum(accepted) / sum(drafts)`` (None without drafts)."""
    drafts = sum(r.drafts for r in results)
    return 1.0 + sum(r.accepted for r in results) / drafts if drafts else None


def require_environment(python: Path = VLLM_PYTHON) -> None:
    """Fail before any weights load when a vLLM peer is asked for without ``.venv-vllm``."""
    if not python.is_file():
        raise ConfigError(f"vLLM peers need the vLLM environment: run `make vllm` (no {python})")


@functools.cache
def unavailable(peer: str, python: Path = VLLM_PYTHON) -> str | None:
    """Why ``peer`` cannot run here (its required module does not import in ``python``'s
    environment), or None when it can. Checked once per process, in a subprocess."""
    module = REQUIRED_MODULES.get(PEER_METHODS[peer])
    if module is None:
        return None
    proc = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return f"`{module}` does not import in {python.parent.parent.name} ({last}); try `make vllm-suffix`"


class VllmSession:
    """A running ``cluster.vllm_runner`` process serving one :class:`VllmSpec`."""

    def __init__(self, spec: VllmSpec, python: Path = VLLM_PYTHON) -> None:
        require_environment(python)
        self.spec = spec
        self.results: list[VllmResult] = []
        self.proc = subprocess.Popen(
            [str(python), "-m", RUNNER_MODULE, spec.to_json()], cwd=REPO_ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        ready = self._read()
        self.version = str(ready["ready"])

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"vLLM runner ({self.spec.method.value}) exited with code {code}; see its stderr")
        return json.loads(line)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig) -> VllmResult:
        request = {"prompt": prompt_ids, "max_new_tokens": max_new_tokens, "sampling": asdict(sampling)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        result = VllmResult(**self._read())
        self.results.append(result)
        return result

    def closed_loop(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
                    concurrency: int) -> VllmClosedLoop:
        """``concurrency`` closed-loop clients over ``prompts`` on this engine (vLLM's continuous
        batching); request i samples with seed ``sampling.seed + i``."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        job = {"prompts": prompts, "max_new_tokens": max_new_tokens, "sampling": asdict(sampling),
               "concurrency": concurrency}
        self.proc.stdin.write(json.dumps({"closed_loop": job}) + "\n")
        self.proc.stdin.flush()
        return VllmClosedLoop(**self._read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


def export_head_for(target: TargetModel, model_dir: Path, dtype: str, out_dir: Path) -> Path:
    """The committed EAGLE-3 head matching ``target`` (``checkpoint: auto``), in vLLM's format."""
    live = TargetFingerprint.from_target(target)
    found = find_checkpoint(CHECKPOINT_ROOT, live, EAGLE3)
    if found is None:
        raise ConfigError(f"vllm_eagle3: no EAGLE-3 checkpoint under {CHECKPOINT_ROOT} fits target {live.name!r}")
    target_config = json.loads((model_dir / "config.json").read_text())
    return export_vllm_eagle3(found, out_dir, target_config, DType.parse(dtype).torch)


_SESSIONS: dict[tuple[str, str, str], VllmSession] = {}
_WORKDIR: list[tempfile.TemporaryDirectory] = []


def session_for(peer: str, target: TargetModel) -> VllmSession:
    """The running session of ``peer`` on ``target``'s weights and dtype (started on first use)."""
    model_dir = Path(str(target.model.config.name_or_path))
    dtype = str(target.model.dtype).removeprefix("torch.")
    key = (peer, str(model_dir), dtype)
    if key not in _SESSIONS:
        method = PEER_METHODS[peer]
        draft = None
        if method == VllmMethod.EAGLE3:
            if not _WORKDIR:
                _WORKDIR.append(tempfile.TemporaryDirectory(prefix="graftblock-vllm-"))
            draft = str(export_head_for(target, model_dir, dtype, Path(_WORKDIR[0].name) / "eagle3"))
        _SESSIONS[key] = VllmSession(VllmSpec(model=str(model_dir), dtype=dtype, method=method, draft=draft))
    return _SESSIONS[key]


def generate(peer: str, target: TargetModel, prompt_ids: list[int], max_new_tokens: int,
             sampling: SamplingConfig) -> GenerationResult:
    """One bench turn by a vLLM peer, as a :class:`GenerationResult` (timing: vLLM's ``generate``)."""
    res = session_for(peer, target).generate(prompt_ids, max_new_tokens, sampling)
    return GenerationResult(tokens=res.tokens, wall_s=res.wall_s, prefill_s=res.prefill_s or 0.0)


def peer_stats(peer: str) -> dict:
    """vLLM's mean acceptance length over every measured turn of ``peer`` (None without drafts)."""
    results = [r for (name, _, _), s in _SESSIONS.items() if name == peer for r in s.results]
    return {"vllm_acceptance_length": acceptance_length(results)}


def reset_stats() -> None:
    """Forget the counters of earlier turns (after the warm-up)."""
    for s in _SESSIONS.values():
        s.results.clear()


@atexit.register
def close_sessions() -> None:
    for s in _SESSIONS.values():
        s.close()
    _SESSIONS.clear()
    for d in _WORKDIR:
        d.cleanup()
    _WORKDIR.clear()
