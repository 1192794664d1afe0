"""Validated configuration dataclasses for every knob of the single-process core.

Each field carries a docstring-style comment; each dataclass validates itself in
``__post_init__`` and raises :class:`ConfigError` (a ``ValueError``) naming the field and the
allowed range. Configs load from plain dicts / YAML with :func:`from_dict`, which rejects unknown
keys by name.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch


class ConfigError(ValueError):
    """A configuration value is out of range or unknown."""


def _check_int(owner: str, name: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{name} must be an integer, got {value!r}")
    _check_range(owner, name, value, lo, hi)


def _check_float(
    owner: str, name: str, value: Any, lo: float | None = None, hi: float | None = None, lo_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(float(value)):
        raise ConfigError(f"{owner}.{name} must be a number, got {value!r}")
    if lo_open and lo is not None and not value > lo:
        raise ConfigError(f"{owner}.{name} must be > {lo}, got {value}")
    _check_range(owner, name, value, None if lo_open else lo, hi)


def _check_range(owner: str, name: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and hi is not None and not lo <= value <= hi:
        raise ConfigError(f"{owner}.{name} must be in [{lo}, {hi}], got {value}")
    if lo is not None and value < lo:
        raise ConfigError(f"{owner}.{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ConfigError(f"{owner}.{name} must be <= {hi}, got {value}")


class DType(str, enum.Enum):
    """Target compute dtype. Exactness is checked in fp32; bf16 is for speed."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    @property
    def torch(self) -> torch.dtype:
        return {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16}[self]

    @classmethod
    def parse(cls, value: "str | DType") -> "DType":
        if isinstance(value, DType):
            return value
        aliases = {"fp32": "float32", "bf16": "bfloat16"}
        try:
            return cls(aliases.get(str(value), str(value)))
        except ValueError:
            raise ConfigError(f"dtype must be one of float32|bfloat16 (or fp32|bf16), got {value!r}") from None


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen, identically for vanilla and speculative decoding."""

    temperature: float = 0.0
    """0 (or <= 1e-5) means greedy; otherwise softmax(z / temperature). Range [0, 100]."""
    top_p: float = 1.0
    """Nucleus truncation, applied after temperature. Range (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep only the k most likely tokens, applied after top-p. 0 disables it."""
    seed: int = 0
    """Seed of the torch.Generator that draws the uniforms and samples."""

    GREEDY_EPS = 1e-5

    def __post_init__(self) -> None:
        _check_float("sampling", "temperature", self.temperature, 0.0, 100.0)
        _check_float("sampling", "top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("sampling", "top_k", self.top_k, 0)
        _check_int("sampling", "seed", self.seed, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature <= self.GREEDY_EPS


@dataclass(frozen=True)
class RetrievalConfig:
    """Knobs of the training-free retrieval drafter (suffix index + token-transition table)."""

    budget: int = 24
    """Maximum number of draft nodes (root excluded) per step. Range [1, 512]."""
    max_match_len: int = 16
    """Depth of the per-request suffix index: the longest context suffix matched. Range [1, 64]."""
    min_match_len: int = 1
    """Shortest suffix match that may propose a continuation. Range [1, max_match_len]."""
    max_depth: int = 12
    """Longest proposed continuation (tree depth). Range [1, 64]."""
    min_token_prob: float = 0.05
    """Drop suffix continuations whose conditional count ratio is below this. Range [0, 1)."""
    transition_topk: int = 4
    """Successors kept per token in the transition table. 0 disables the table. Range [0, 16]."""
    transition_fill: bool = True
    """Fill budget left over by suffix matching with walks of the transition table."""
    transition_width: int = 2
    """Children per node when expanding from the transition table. Range [1, transition_topk]."""
    cost_aware: bool = True
    """Cut each tree to the size the measured verify curve c(T) favours (see speculation.cost)."""
    datastore: str | None = None
    """Optional path to a corpus datastore (a .npy of token ids) matched like REST."""
    datastore_match_len: int = 8
    """Longest suffix looked up in the datastore. Range [1, 32]."""

    def __post_init__(self) -> None:
        o = "retrieval"
        _check_int(o, "budget", self.budget, 1, 512)
        _check_int(o, "max_match_len", self.max_match_len, 1, 64)
        _check_int(o, "min_match_len", self.min_match_len, 1, self.max_match_len)
        _check_int(o, "max_depth", self.max_depth, 1, 64)
        _check_float(o, "min_token_prob", self.min_token_prob, 0.0, 1.0)
        if self.min_token_prob >= 1.0:
            raise ConfigError(f"{o}.min_token_prob must be < 1, got {self.min_token_prob}")
        _check_int(o, "transition_topk", self.transition_topk, 0, 16)
        if self.transition_topk:
            _check_int(o, "transition_width", self.transition_width, 1, self.transition_topk)
        _check_int(o, "datastore_match_len", self.datastore_match_len, 1, 32)
        if self.datastore is not None and not Path(self.datastore).exists():
            raise ConfigError(f"{o}.datastore: no such file {self.datastore!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Decode-loop settings shared by every method."""

    max_new_tokens: int = 128
    """Tokens to generate per turn. Range [1, 65536]."""
    stop_at_eos: bool = True
    """Stop at the tokenizer's end-of-sequence token(s)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        _check_int("engine", "max_new_tokens", self.max_new_tokens, 1, 65536)


@dataclass(frozen=True)
class GraftConfig:
    """Knobs of Graft (``speculation/drafters/graft.py``; ALGORITHMS.md sections 0, 5, 6).

    Per step the EAGLE-3 drafter grows its beam level by level and may stop at each *stage* (a
    drafter depth) when the beam's path mass ``sum_b exp(S_b)`` falls under ``threshold``; stage 0
    means "no drafter this step, retrieval only" and is taken when the retrieval tree's expected
    accepted length ``sum_i p_i`` reaches ``retrieval_confidence``. The pruned tree keeps at most
    ``N_s`` drafter nodes for the stage it stopped at; retrieved tokens are grafted into the
    ``dense_budget - 1 - |pruned|`` freed slots (at most ``graft_budget``).
    """

    AUTO = 0
    TREE_DRAFTERS = ("eagle3",)

    drafter: str = "eagle3"
    """The tree drafter Graft prunes (one that can stop early). One of TREE_DRAFTERS."""
    stages: tuple[int, ...] = (0, 1, 5)
    """Drafter depths (levels below the root) at which drafting may stop, ascending; 0 = retrieval
    only. The largest is the dense depth. Each in [0, 33], at least one > 0 unless only (0,)."""
    threshold: float = 0.3
    """Stop at a stage when the beam's path mass sum_b exp(S_b) is below this. Range [0, 1]."""
    retrieval_confidence: float = 3.0
    """Stage 0 (skip the drafter) when the retrieval tree's expected accepted length sum_i p_i is
    at least this. Range [0, 1024]; a value above the graft budget never skips."""
    dense_budget: int = 48
    """K_max: verified tree size of the dense tree, root included (the size a dense EAGLE-3 tree
    would have); 0 = choose it per step from the measured c(T) and the drafter's measured
    acceptance by rank (the T maximising expected accepted tokens per second). Range 0 or [2, 1024]."""
    stage_budgets: tuple[int, ...] = ()
    """Drafter nodes kept at each stage, one per stage (stage 0's must be 0); empty = derived:
    N_s = min(K_max - 1, max(top_k, ceil((K_max - 1) * s / max_stage)))."""
    graft_budget: int = 16
    """Most retrieved nodes grafted per step (and never beyond the freed slots). Range [0, 1024]."""
    top_k: int = 8
    """EAGLE-3 beam width and children per expanded node. Range [1, 64]."""
    checkpoint: str = "auto"
    """EAGLE-3 checkpoint: ``auto`` | ``random`` | a path (see Eagle3Config.checkpoint)."""
    draft_vocab_size: int = 8192
    """Draft vocabulary of a ``random`` head. Range [1, 1048576]."""
    seed: int = 0
    """Initialisation seed of a ``random`` head. Range >= 0."""
    min_match_len: int = 1
    """Retrieval: shortest suffix match that may propose. Range [1, max_match_len]."""
    max_match_len: int = 16
    """Retrieval: longest context suffix matched. Range [1, 64]."""
    retrieval_budget: int = 24
    """Retrieval candidates proposed per step (before grafting dedups them). Range [1, 512]."""
    transition_topk: int = 4
    """Retrieval: successors kept per token in the adjacency table (0 = off). Range [0, 16]."""

    AUTO_MAX = 128
    """Largest K_max the automatic choice considers."""

    def __post_init__(self) -> None:
        o = "graft"
        if self.drafter not in self.TREE_DRAFTERS:
            raise ConfigError(f"{o}.drafter must be one of {list(self.TREE_DRAFTERS)}, got {self.drafter!r}")
        stages = self.stages
        if isinstance(stages, (int, float)) or not isinstance(stages, (list, tuple)) or not stages:
            raise ConfigError(f"{o}.stages must be a non-empty list of depths, e.g. [0, 1, 5], got {stages!r}")
        for s in stages:
            _check_int(o, "stages[]", s, 0, 33)
        if list(stages) != sorted(set(stages)):
            raise ConfigError(f"{o}.stages must be strictly ascending without repeats, got {list(stages)}")
        object.__setattr__(self, "stages", tuple(stages))
        _check_float(o, "threshold", self.threshold, 0.0, 1.0)
        _check_float(o, "retrieval_confidence", self.retrieval_confidence, 0.0, 1024.0)
        _check_int(o, "dense_budget", self.dense_budget, 0, 1024)
        if self.dense_budget == 1:
            raise ConfigError(f"{o}.dense_budget must be 0 (auto) or in [2, 1024], got 1")
        _check_int(o, "graft_budget", self.graft_budget, 0, 1024)
        _check_int(o, "top_k", self.top_k, 1, 64)
        _check_int(o, "draft_vocab_size", self.draft_vocab_size, 1, 1 << 20)
        _check_int(o, "seed", self.seed, 0)
        _check_int(o, "max_match_len", self.max_match_len, 1, 64)
        _check_int(o, "min_match_len", self.min_match_len, 1, self.max_match_len)
        _check_int(o, "retrieval_budget", self.retrieval_budget, 1, 512)
        _check_int(o, "transition_topk", self.transition_topk, 0, 16)
        budgets = tuple(self.stage_budgets or ())
        if budgets:
            if len(budgets) != len(self.stages):
                raise ConfigError(
                    f"{o}.stage_budgets needs one entry per stage ({len(self.stages)} for {list(self.stages)}), "
                    f"got {list(budgets)}"
                )
            for s, n in zip(self.stages, budgets):
                _check_int(o, f"stage_budgets[stage {s}]", n, 0, 1024)
                if (s == 0) != (n == 0):
                    raise ConfigError(f"{o}.stage_budgets: stage {s} must keep {'0' if s == 0 else '>= 1'} nodes, got {n}")
        object.__setattr__(self, "stage_budgets", budgets)
        if not isinstance(self.checkpoint, str) or not self.checkpoint.strip():
            raise ConfigError(f"{o}.checkpoint must be 'auto', 'random' or a path, got {self.checkpoint!r}")

    @property
    def max_stage(self) -> int:
        return self.stages[-1]

    @property
    def cost_aware(self) -> bool:
        """Automatic K_max needs the measured verify curve c(T)."""
        return self.dense_budget == self.AUTO

    @property
    def budget(self) -> int:
        """Largest number of draft nodes (root excluded) a step can verify."""
        return (self.dense_budget or self.AUTO_MAX) - 1

    def stage_budget(self, stage: int, k_max: int) -> int:
        """N_s: drafter nodes kept when drafting stopped at ``stage`` (tree size ``k_max``)."""
        if stage == 0:
            return 0
        if self.stage_budgets:
            return min(k_max - 1, self.stage_budgets[self.stages.index(stage)])
        return min(k_max - 1, max(self.top_k, math.ceil((k_max - 1) * stage / self.max_stage)))

    def eagle3(self, total_tokens: int) -> "Eagle3Config":
        """The drafter's config for a dense tree of ``total_tokens`` (depth = max stage - 1)."""
        depth = max(1, self.max_stage - 1)
        pool = self.top_k + depth * self.top_k**2
        return Eagle3Config(total_tokens=min(total_tokens, pool + 1), depth=depth, top_k=self.top_k,
                            checkpoint=self.checkpoint, draft_vocab_size=self.draft_vocab_size, seed=self.seed)

    def retrieval(self) -> RetrievalConfig:
        """The retrieval source's config: no cost cut of its own (the hybrid tree is sized here)."""
        return RetrievalConfig(budget=self.retrieval_budget, min_match_len=self.min_match_len,
                               max_match_len=self.max_match_len, transition_topk=self.transition_topk,
                               transition_width=min(2, max(1, self.transition_topk)), cost_aware=False)


T = TypeVar("T")


def from_dict(cls: type[T], data: Mapping[str, Any] | None, where: str | None = None) -> T:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys with a message naming them.

    Nested dataclass fields are built recursively from nested mappings.
    """
    data = dict(data or {})
    where = where or cls.__name__
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        sub = _NESTED.get((cls.__name__, name))
        if sub is not None and isinstance(value, Mapping):
            value = from_dict(sub, value, f"{where}.{name}")
        kwargs[name] = value
    return cls(**kwargs)




def to_dict(obj: Any) -> dict[str, Any]:
    """A plain, YAML/JSON-friendly dict of a config dataclass."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, enum.Enum):
            v = v.value
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


@dataclass(frozen=True)
class BenchConfig:
    """One ``graftblock bench`` invocation (the Bench CLI contract in DESIGN.md)."""

    methods: tuple[str, ...] = ("vanilla", "retrieval")
    """Methods to run; ``vanilla`` (the baseline) is always run first if not listed."""
    model: str = "smollm2-135m"
    """Packaged alias, Hugging Face id or local directory."""
    dtype: DType = DType.BFLOAT16
    dataset: str = "spec_bench"
    """``spec_bench``, a packaged dataset name, or a path to a Spec-Bench-format jsonl."""
    limit_per_category: int | None = None
    """Keep the first N questions of each category. Range [1, 100000] or None for all."""
    max_new_tokens: int = 128
    """New tokens per turn. Range [1, 65536]."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    peers: tuple[str, ...] = ()
    """Peer loops run on the same prompts: ``hf_generate``, ``hf_prompt_lookup``."""
    warmup: int = 1
    """Untimed warm-up generations per method before measuring. Range [0, 10]."""
    max_turns: int | None = None
    """Only run the first N turns of multi-turn questions (None = all). Range [1, 10]."""
    threads: int | None = None
    """torch intra-op threads (None = leave torch's default). Range [1, 256]."""

    def __post_init__(self) -> None:
        if not self.methods:
            raise ConfigError("bench.methods must name at least one method")
        object.__setattr__(self, "methods", tuple(self.methods))
        object.__setattr__(self, "peers", tuple(self.peers))
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        if self.limit_per_category is not None:
            _check_int("bench", "limit_per_category", self.limit_per_category, 1, 100000)
        _check_int("bench", "max_new_tokens", self.max_new_tokens, 1, 65536)
        _check_int("bench", "warmup", self.warmup, 0, 10)
        if self.max_turns is not None:
            _check_int("bench", "max_turns", self.max_turns, 1, 10)
        if self.threads is not None:
            _check_int("bench", "threads", self.threads, 1, 256)


_NESTED: dict[tuple[str, str], type] = {
    ("EngineConfig", "sampling"): SamplingConfig,
    ("BenchConfig", "sampling"): SamplingConfig,
}


@dataclass(frozen=True)
class Eagle3Config:
    """Knobs of the EAGLE-3 dynamic-tree drafter (ALGORITHMS.md section 3).

    The tree grows ``depth`` levels below the first one (one drafter forward each) with beam
    width ``top_k``; the pool of ``top_k + depth * top_k**2`` candidates is reranked by cumulative
    log-probability to ``total_tokens - 1`` draft nodes (so the verified tree, root included,
    holds at most ``total_tokens`` tokens and is at most ``depth + 1`` deep).
    """

    AUTO = "auto"
    RANDOM = "random"

    total_tokens: int = 48
    """Verified tree size, root included (EAGLE's ``total_token``). Range [2, 1024]."""
    depth: int = 5
    """Expansion forwards after the first draft level; max tree depth is depth + 1. Range [1, 32]."""
    top_k: int = 8
    """Beam width and children per expanded node. Range [1, 64]."""
    checkpoint: str = "auto"
    """``auto`` (the committed checkpoint under ``<repo>/checkpoints`` matching the target),
    ``random`` (untrained head: tests and baselines), or a checkpoint directory / .safetensors."""
    draft_vocab_size: int = 8192
    """Draft vocabulary of a ``random`` head (a checkpoint brings its own). Range [1, 1048576]."""
    seed: int = 0
    """Initialisation seed of a ``random`` head. Range >= 0."""

    def __post_init__(self) -> None:
        o = "eagle3"
        _check_int(o, "total_tokens", self.total_tokens, 2, 1024)
        _check_int(o, "depth", self.depth, 1, 32)
        _check_int(o, "top_k", self.top_k, 1, 64)
        _check_int(o, "draft_vocab_size", self.draft_vocab_size, 1, 1 << 20)
        _check_int(o, "seed", self.seed, 0)
        pool = self.top_k + self.depth * self.top_k**2
        if self.total_tokens - 1 > pool:
            raise ConfigError(
                f"{o}.total_tokens - 1 = {self.total_tokens - 1} exceeds the candidate pool top_k + depth * "
                f"top_k^2 = {pool} (top_k={self.top_k}, depth={self.depth}); lower total_tokens or raise top_k/depth"
            )
        if not isinstance(self.checkpoint, str) or not self.checkpoint.strip():
            raise ConfigError(f"{o}.checkpoint must be 'auto', 'random' or a path, got {self.checkpoint!r}")
        if self.checkpoint not in (self.AUTO, self.RANDOM) and not Path(self.checkpoint).expanduser().exists():
            raise ConfigError(f"{o}.checkpoint: no such file or directory {self.checkpoint!r}")


@dataclass(frozen=True)
class SpecBlockConfig:
    """Knobs of the SpecBlock block drafter (ALGORITHMS.md section 4; ``drafters/specblock.py``).

    One drafter forward emits ``block_size`` dependent positions. Block 1 drafts a greedy chain at
    the root; the rank head's class per slot sets how many alternatives branch there
    (``slot_widths[class]``); the best ``beam`` pending leaves then seed up to ``max_blocks - 1``
    further blocks (one forward each). The pool is reranked by cumulative log-probability to
    ``total_tokens - 1`` draft nodes.
    """

    AUTO = "auto"
    RANDOM = "random"
    RANK_CLASSES = 4

    total_tokens: int = 48
    """Verified tree size, root included. Range [2, 1024]."""
    block_size: int = 4
    """K: positions per drafter forward; at most the checkpoint's K (a prefix of its slots is
    exact, since slot k depends only on slots < k). Range [1, 16]."""
    max_blocks: int = 2
    """Block expansions per step (drafter forwards after encoding, at most). Range [1, 8]."""
    beam: int = 8
    """Pending leaves kept per block, and the root slot's width. Range [1, 64]."""
    slot_widths: tuple[int, ...] = (2, 4, 6, 4)
    """Tokens drafted at a slot per rank class (continue, branch-few, branch-many, give-up);
    1 = greedy only, 0 = stop the chain there. Four entries, each in [0, 64]."""
    rank_head: bool = True
    """Use the rank head's classes; False = fixed width ``top_k`` at every slot (the ablation)."""
    top_k: int = 4
    """Width per slot when ``rank_head`` is False. Range [1, 64]."""
    adaptive_widths: bool = True
    """Narrow confident slots: p0 >= .9/.8/.6 caps slot 0 at 3/5/8, p >= .95/.85 caps others at 2/3."""
    checkpoint: str = "auto"
    """``auto`` (the committed SpecBlock checkpoint matching the target), ``random``, or a path."""
    draft_vocab_size: int = 8192
    """Draft vocabulary of a ``random`` head. Range [1, 1048576]."""
    num_layers: int = 2
    """Decoder layers of a ``random`` head. Range [1, 8]."""
    shift: bool = True
    """Layer-wise shift in a ``random`` head (a checkpoint records its own)."""
    seed: int = 0
    """Initialisation seed of a ``random`` head. Range >= 0."""

    def __post_init__(self) -> None:
        o = "specblock"
        _check_int(o, "total_tokens", self.total_tokens, 2, 1024)
        _check_int(o, "block_size", self.block_size, 1, 16)
        _check_int(o, "max_blocks", self.max_blocks, 1, 8)
        _check_int(o, "beam", self.beam, 1, 64)
        widths = self.slot_widths
        if not isinstance(widths, (list, tuple)) or len(widths) != self.RANK_CLASSES:
            raise ConfigError(f"{o}.slot_widths must be a list of {self.RANK_CLASSES} widths, got {widths!r}")
        for w in widths:
            _check_int(o, "slot_widths[]", w, 0, 64)
        if widths[0] < 1:
            raise ConfigError(f"{o}.slot_widths[0] (the 'continue' class) must be >= 1, got {widths[0]}")
        object.__setattr__(self, "slot_widths", tuple(widths))
        for name in ("rank_head", "adaptive_widths", "shift"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{o}.{name} must be true or false, got {getattr(self, name)!r}")
        _check_int(o, "top_k", self.top_k, 1, 64)
        _check_int(o, "draft_vocab_size", self.draft_vocab_size, 1, 1 << 20)
        _check_int(o, "num_layers", self.num_layers, 1, 8)
        _check_int(o, "seed", self.seed, 0)
        if not isinstance(self.checkpoint, str) or not self.checkpoint.strip():
            raise ConfigError(f"{o}.checkpoint must be 'auto', 'random' or a path, got {self.checkpoint!r}")
        if self.checkpoint not in (self.AUTO, self.RANDOM) and not Path(self.checkpoint).expanduser().exists():
            raise ConfigError(f"{o}.checkpoint: no such file or directory {self.checkpoint!r}")
