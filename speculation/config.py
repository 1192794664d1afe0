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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import torch
import yaml


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
    if lo_open and lo is not None and not (value > lo and (hi is None or value <= hi)):
        bound = f"> {lo}" if hi is None else f"in ({lo}, {hi}]"
        raise ConfigError(f"{owner}.{name} must be {bound}, got {value}")
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
    """Cut each tree to the size the measured verify curve c(T) favours (see speculation.policy.cost)."""
    datastore: str | None = None
    """Optional path to a corpus datastore (a .npy of token ids) matched like REST."""
    datastore_match_len: int = 8
    """Longest suffix looked up in the datastore. Range [1, 32]."""
    store_tokens: int = 0
    """Capacity in tokens of the cross-request suffix store (earlier requests' outputs, shared by
    every sequence of a batched engine or serving replica; speculation.drafters.suffix_store).
    0 = off. Range [0, 1e9]."""
    store_prompts: bool = False
    """Also store each finished request's prompt, not only its output."""
    store_key_len: int = 3
    """n of the store's n-gram index: the shortest cross-request match proposed from. Range [1, 16]."""
    store_depth_factor: float = 2.0
    """Store continuations are cut at ceil(store_depth_factor * match length) tokens (and at
    max_depth). Range (0, 64]."""

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
        _check_int(o, "store_tokens", self.store_tokens, 0, 10**9)
        _check_int(o, "store_key_len", self.store_key_len, 1, 16)
        _check_float(o, "store_depth_factor", self.store_depth_factor, 0.0, 64.0, lo_open=True)
        if self.datastore is not None and not Path(self.datastore).exists():
            raise ConfigError(f"{o}.datastore: no such file {self.datastore!r}")

    def verify_curve_size(self) -> int:
        """Largest tree size T (root included) whose verify cost c(T) the drafter needs: the full
        budget plus the root when ``cost_aware``, else 0 (no measured curve needed)."""
        return self.budget + 1 if self.cost_aware else 0


@dataclass(frozen=True)
class EngineConfig:
    """Decode-loop settings shared by every method."""

    max_new_tokens: int = 128
    """Tokens to generate per turn. Range [1, 65536]."""
    stop_at_eos: bool = True
    """Stop at the tokenizer's end-of-sequence token(s)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prefill_chunk_tokens: int | None = None
    """Prefill the prompt in forwards of at most this many tokens (``TargetModel.prefill``'s
    ``chunk_tokens``); None = one forward. The batched engine's ``batch.prefill_chunk_tokens``
    gives the same bits as this solo loop with the same value. Range [1, 1048576]."""

    def __post_init__(self) -> None:
        _check_int("engine", "max_new_tokens", self.max_new_tokens, 1, 65536)
        if self.prefill_chunk_tokens is not None:
            _check_int("engine", "prefill_chunk_tokens", self.prefill_chunk_tokens, 1, 1 << 20)


class StagedTreeConfig(Protocol):
    """What Graft reads from its tree drafter's config (Eagle3Config, SpecBlockConfig) to stage and
    size that drafter; the drafter itself implements ``speculation.drafters.base.StagedDrafter``."""

    GRAFT_SIZED: ClassVar[Mapping[str, int]]
    """The fields Graft sets (:meth:`for_graft`), at their smallest valid values; a
    ``graft.tree_drafter`` section may not set them."""

    @property
    def level_step(self) -> int:
        """Tree levels one drafter forward adds: every Graft stage is a multiple of it."""
        ...

    @property
    def max_levels(self) -> int:
        """The deepest tree the drafter can grow: the largest stage allowed."""
        ...

    @property
    def first_level_width(self) -> int:
        """Nodes of the first drafted level: a stage never keeps fewer drafter nodes."""
        ...

    def graft_stages(self) -> tuple[int, ...]:
        """The stages Graft uses when its ``stages`` is empty (0 = retrieval only)."""
        ...

    def for_graft(self, levels: int, total_tokens: int) -> StagedTreeConfig:
        """This config drafting at most ``levels`` levels into trees of ``total_tokens`` (root included)."""
        ...


def _as_graft_option(kind: str, build: Callable[[], T]) -> T:
    """``build()``, with a tree drafter config's errors (``"<kind>.<field> ..."``) renamed to the
    field's place under Graft (``"graft.tree_drafter.<field> ..."``)."""
    try:
        return build()
    except ConfigError as exc:
        msg = str(exc)
        if msg.startswith(f"{kind}."):
            msg = "graft.tree_drafter." + msg[len(kind) + 1 :]
        raise ConfigError(msg) from None


class BatchLayout(str, enum.Enum):
    """How a target lays out one batched verify forward (what its cost depends on).

    PADDED: every row padded to the largest tree (``[B, max_b T_b]``; one masked attention over
    the longest row's keys), so the step costs as if every row had the largest tree.
    FLAT: the rows' tokens packed one after another (``[1, sum_b T_b]``; attention per row over its
    own keys), so the step costs what its real tokens cost.
    """

    PADDED = "padded"
    FLAT = "flat"


class StageUnit(str, enum.Enum):
    """What Graft's ``stages`` count."""

    LEVELS = "levels"
    """Tree levels below the root (the stored form)."""
    FORWARDS = "forwards"
    """Tree-drafter forwards: stage s is s * (levels one forward adds) levels, so a sweep can search
    the stages and SpecBlock's block_size together ([0, 1, 2] is [0, K, 2K] for every K)."""


@dataclass(frozen=True)
class GraftConfig:
    """Knobs of Graft (``speculation/drafters/graft.py``; docs/algorithms.md §0, §5, §6).

    Graft prunes the tree of a *tree drafter* (``tree_drafter``: EAGLE-3 or SpecBlock) and grafts
    retrieved tokens into the slots pruning freed. Per step the tree drafter grows level by level
    (EAGLE-3: one level per forward; SpecBlock: K levels per block) and may stop at each *stage* (a
    drafter depth) when the path mass of its open leaves ``sum_b exp(S_b)`` falls under
    ``threshold``; stage 0 means "no drafter this step, retrieval only" and is taken when the
    drafter gate says calling the drafter does not pay this step (its expected marginal accepted
    tokens, priced by the per-token time, do not exceed its measured drafting time plus the extra
    verify cost of its nodes). The pruned tree keeps at most ``N_s`` drafter nodes for the stage it
    stopped at; retrieved tokens, anchored at the root and at the ``graft_anchors`` kept drafter
    nodes of highest path mass, are grafted best-first into the ``dense_budget - 1 - |pruned|``
    freed slots (at most ``graft_budget``).
    """

    AUTO = 0
    DEFAULT_TREE_DRAFTER = "eagle3"

    tree_drafter: Mapping[str, Any] = field(default_factory=lambda: {"type": GraftConfig.DEFAULT_TREE_DRAFTER},
                                            hash=False)
    """The tree drafter Graft prunes: ``{type: eagle3 | specblock, <its options>}`` (type defaults to
    eagle3). The options are that drafter's own (``Eagle3Config``: checkpoint, top_k, ...;
    ``SpecBlockConfig``: checkpoint, block_size, beam, slot_widths, ...), validated by its config
    class. Its depth and tree size are Graft's (``stages``, ``dense_budget``), so ``total_tokens``
    and ``depth`` / ``max_blocks`` are not options here. Stored resolved: every option, type first."""
    stages: tuple[int, ...] = ()
    """Drafter depths (levels below the root) at which drafting may stop, ascending; 0 = retrieval
    only; the largest is the dense depth. A stage > 0 is a multiple of the levels one drafter forward
    adds (EAGLE-3: 1; SpecBlock: block_size) and at most the drafter's deepest tree (EAGLE-3: 33;
    SpecBlock: 8 * block_size). Empty = the tree drafter's default: [0, 1, 5] (EAGLE-3), [0, K, 2K]
    (SpecBlock, K = block_size)."""
    stage_unit: StageUnit = StageUnit.LEVELS
    """What ``stages`` count: ``levels`` or ``forwards`` (of the tree drafter: EAGLE-3 adds 1 level
    per forward, SpecBlock block_size). Stored resolved: the config keeps levels, so the unit reads
    ``levels`` once built."""
    threshold: float = 0.3
    """Stop at a stage when the open leaves' path mass sum_b exp(S_b) is below this. Range [0, 1]."""
    gate_warmup: int = 4
    """Drafter gate (when 0 is a stage): drafter calls per retrieval-confidence bucket before the
    gate trusts its measured marginal gain; until then the drafter is called. Range [0, 1000]."""
    dense_budget: int = 48
    """K_max: verified tree size of the dense tree, root included (the size the tree drafter's
    dense tree would have); 0 = choose it per step from the measured c(T) and the drafter's measured
    acceptance by rank (the T maximising expected accepted tokens per second). Range 0 or [2, 1024]."""
    stage_budgets: tuple[int, ...] = ()
    """Drafter nodes kept at each stage, one per stage (stage 0's must be 0); empty = derived:
    N_s = min(K_max - 1, max(w_1, ceil((K_max - 1) * s / max_stage))), w_1 = the width of the
    drafter's first level (EAGLE-3: top_k; SpecBlock: beam)."""
    graft_budget: int = 16
    """Most retrieved nodes grafted per step (and never beyond the freed slots). Range [0, 1024]."""
    graft_anchors: int = 4
    """Kept drafter nodes (highest path mass first) whose own path is also retrieved on and grafted
    under, besides the root; 0 = root-anchored retrieval only. Range [0, 64]."""
    min_match_len: int = 1
    """Retrieval: shortest suffix match that may propose. Range [1, max_match_len]."""
    max_match_len: int = 16
    """Retrieval: longest context suffix matched. Range [1, 64]."""
    retrieval_budget: int = 24
    """Retrieval candidates proposed per step (before grafting dedups them). Range [1, 512]."""
    transition_topk: int = 4
    """Retrieval: successors kept per token in the adjacency table (0 = off). Range [0, 16]."""
    cost_cut: bool = True
    """Cut every verified tree (retrieval-only, or drafter + grafts) to its cost-optimal best-first
    prefix: with p_i each node's calibrated probability of being accepted (drafter nodes: the
    acceptance of their score rank; retrieved nodes: their calibrated path probability), keep the n
    best nodes maximising ``(1 + sum_{i<=n} p_i) / (c(n + 1, L) + d)`` on the measured c(T, L).
    Grafts that cost more verify time than they add accepted tokens are not verified, so Graft is
    never priced above its sources. Needs c(T): it is measured whenever this is true."""

    AUTO_MAX = 128
    """Largest K_max the automatic choice considers."""

    def __post_init__(self) -> None:
        o = "graft"
        kind, base = self._tree_options()
        try:
            unit = StageUnit(self.stage_unit)
        except ValueError:
            allowed = ", ".join(u.value for u in StageUnit)
            raise ConfigError(f"{o}.stage_unit must be one of {allowed}, got {self.stage_unit!r}") from None
        stages = self.stages if self.stages else base.graft_stages()
        if isinstance(stages, (int, float)) or not isinstance(stages, (list, tuple)):
            raise ConfigError(f"{o}.stages must be a list of depths, e.g. [0, 1, 5], got {stages!r}")
        if unit == StageUnit.FORWARDS and self.stages:
            for s in stages:
                _check_int(o, "stages[] (forwards)", s, 0, base.max_levels // base.level_step)
            stages = [s * base.level_step for s in stages]
        object.__setattr__(self, "stage_unit", StageUnit.LEVELS)
        for s in stages:
            _check_int(o, "stages[]", s, 0, base.max_levels)
        if list(stages) != sorted(set(stages)):
            raise ConfigError(f"{o}.stages must be strictly ascending without repeats, got {list(stages)}")
        off = [s for s in stages if s % base.level_step]
        if off:
            raise ConfigError(
                f"{o}.stages must be multiples of {base.level_step} (a {kind} forward drafts {base.level_step} "
                f"levels: its block_size), got {list(stages)}"
            )
        object.__setattr__(self, "stages", tuple(stages))
        _check_float(o, "threshold", self.threshold, 0.0, 1.0)
        _check_int(o, "gate_warmup", self.gate_warmup, 0, 1000)
        _check_int(o, "dense_budget", self.dense_budget, 0, 1024)
        if self.dense_budget == 1:
            raise ConfigError(f"{o}.dense_budget must be 0 (auto) or in [2, 1024], got 1")
        _check_int(o, "graft_budget", self.graft_budget, 0, 1024)
        _check_int(o, "graft_anchors", self.graft_anchors, 0, 64)
        _check_int(o, "max_match_len", self.max_match_len, 1, 64)
        _check_int(o, "min_match_len", self.min_match_len, 1, self.max_match_len)
        _check_int(o, "retrieval_budget", self.retrieval_budget, 1, 512)
        _check_int(o, "transition_topk", self.transition_topk, 0, 16)
        if not isinstance(self.cost_cut, bool):
            raise ConfigError(f"{o}.cost_cut must be true or false, got {self.cost_cut!r}")
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
        levels = max(self.max_stage, base.level_step)  # stages [0] alone: the drafter is never built
        tree = _as_graft_option(kind, lambda: base.for_graft(levels, self.dense_budget or self.AUTO_MAX))
        resolved = {k: v for k, v in to_dict(base).items() if k not in base.GRAFT_SIZED}
        object.__setattr__(self, "tree_drafter", {"type": kind, **resolved})
        object.__setattr__(self, "_tree", tree)

    def _tree_options(self) -> tuple[str, StagedTreeConfig]:
        """``tree_drafter``'s type and its options validated by that drafter's config class (with
        the fields Graft sizes at their smallest values)."""
        raw = self.tree_drafter
        if not isinstance(raw, Mapping):
            raise ConfigError(f"graft.tree_drafter must be a mapping like {{type: specblock, checkpoint: auto}}, got {raw!r}")
        options = dict(raw)
        kind = options.pop("type", self.DEFAULT_TREE_DRAFTER)
        if kind not in TREE_DRAFTER_CONFIGS:
            raise ConfigError(f"graft.tree_drafter.type must be one of {sorted(TREE_DRAFTER_CONFIGS)}, got {kind!r}")
        cls = TREE_DRAFTER_CONFIGS[kind]
        sized = sorted(set(options) & set(cls.GRAFT_SIZED))
        if sized:
            raise ConfigError(
                f"graft.tree_drafter.{'/'.join(sized)} is set by Graft (the depth by graft.stages, the tree size "
                "by graft.dense_budget); remove it"
            )
        allowed = sorted(f.name for f in dataclasses.fields(cls) if f.init and f.name not in cls.GRAFT_SIZED)
        unknown = sorted(set(options) - set(allowed), key=str)
        if unknown:
            raise ConfigError(f"graft.tree_drafter: unknown key(s) {unknown} for tree drafter type {kind}; allowed: "
                              f"{['type', *allowed]}")
        return kind, _as_graft_option(kind, lambda: cls(**options, **cls.GRAFT_SIZED))

    @property
    def tree(self) -> Eagle3Config | SpecBlockConfig:
        """The tree drafter's config as Graft runs it: ``tree_drafter``'s options, ``max_stage``
        levels deep, trees of ``dense_budget`` tokens (``AUTO_MAX`` when automatic)."""
        return self._tree

    @property
    def tree_type(self) -> str:
        """The tree drafter's type (``tree_drafter["type"]``)."""
        return self.tree_drafter["type"]

    @property
    def max_stage(self) -> int:
        return self.stages[-1]

    def verify_curve_size(self) -> int:
        """Largest tree size T (root included) whose verify cost c(T) Graft needs: ``AUTO_MAX``
        when ``dense_budget`` is 0 (K_max chosen from c(T)); ``dense_budget`` when the drafter gate
        runs (0 is a stage and a drafter exists: it prices nodes by c(T)) or ``cost_cut`` is on;
        else 0."""
        if self.dense_budget == self.AUTO:
            return self.AUTO_MAX
        return self.dense_budget if (self.gated or self.cost_cut) else 0

    @property
    def gated(self) -> bool:
        """Whether the per-step drafter gate runs: stage 0 (retrieval only) and a drafter stage."""
        return self.stages[0] == 0 and self.max_stage > 0

    def stage_budget(self, stage: int, k_max: int) -> int:
        """N_s: drafter nodes kept when drafting stopped at ``stage`` (tree size ``k_max``)."""
        if stage == 0:
            return 0
        if self.stage_budgets:
            return min(k_max - 1, self.stage_budgets[self.stages.index(stage)])
        return min(k_max - 1, max(self.tree.first_level_width, math.ceil((k_max - 1) * stage / self.max_stage)))

    def retrieval(self) -> RetrievalConfig:
        """The retrieval source's config: no cost cut of its own (the hybrid tree is sized here)."""
        return RetrievalConfig(budget=self.retrieval_budget, min_match_len=self.min_match_len,
                               max_match_len=self.max_match_len, transition_topk=self.transition_topk,
                               transition_width=min(2, max(1, self.transition_topk)), cost_aware=False)


T = TypeVar("T")



def load_yaml_mapping(path: str | Path, what: str, expected: str) -> dict[str, Any]:
    """The top-level mapping of YAML file ``path``, or a :class:`ConfigError` that names ``what``
    (e.g. ``"--config"``) and the file: missing, not valid YAML, or not a mapping of ``expected``.
    An empty file is an empty mapping."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{what}: no such file {str(path)!r}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: expected a mapping of {expected}")
    return data

def from_dict(cls: type[T], data: Mapping[str, Any] | None, where: str | None = None) -> T:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys with a message naming them.

    Nested dataclass fields are built recursively from nested mappings.
    """
    data = dict(data or {})
    where = where or cls.__name__
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)
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
    """One ``graftblock bench`` invocation (the bench contract, docs/architecture.md §5)."""

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
    batch_invariant: bool = False
    """Run the target's products in row groups within each kernel's invariant limit
    (:class:`~speculation.model.target.TargetModel`'s ``batch_invariant``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError(f"bench.batch_invariant must be true or false, got {self.batch_invariant!r}")
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


def parse_concurrency(text: str | None) -> list[int]:
    """``--concurrency 1,4,8`` -> [1, 4, 8] (each in [1, 1024]); [] for an empty value."""
    if not text:
        return []
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--concurrency must be comma-separated integers, got {text!r}") from None
    if not levels or any(not 1 <= n <= 1024 for n in levels):
        raise ConfigError(f"--concurrency values must be in [1, 1024], got {text!r}")
    return levels


_NESTED: dict[tuple[str, str], type] = {
    ("EngineConfig", "sampling"): SamplingConfig,
    ("BenchConfig", "sampling"): SamplingConfig,
}


@dataclass(frozen=True)
class Eagle3Config:
    """Knobs of the EAGLE-3 dynamic-tree drafter (docs/algorithms.md §3).

    The tree grows ``depth`` levels below the first one (one drafter forward each) with beam
    width ``top_k``; the pool of ``top_k + depth * top_k**2`` candidates is reranked by cumulative
    log-probability to ``total_tokens - 1`` draft nodes (so the verified tree, root included,
    holds at most ``total_tokens`` tokens and is at most ``depth + 1`` deep).
    """

    AUTO = "auto"
    RANDOM = "random"
    MAX_DEPTH = 32
    GRAFT_SIZED = {"total_tokens": 2, "depth": 1}
    """Fields Graft sets (:class:`StagedTreeConfig`), at their smallest valid values."""

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
        _check_int(o, "depth", self.depth, 1, self.MAX_DEPTH)
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

    def verify_curve_size(self) -> int:
        """0: the tree size is configured; no measured verify curve c(T) is needed."""
        return 0

    # ------------------------------------------------------------------ as Graft's tree drafter
    @property
    def level_step(self) -> int:
        """One tree level per drafter forward."""
        return 1

    @property
    def max_levels(self) -> int:
        """The first level plus ``MAX_DEPTH`` expansions."""
        return self.MAX_DEPTH + 1

    @property
    def first_level_width(self) -> int:
        """The first level holds the ``top_k`` best tokens."""
        return self.top_k

    def graft_stages(self) -> tuple[int, ...]:
        """Prune after the first level, dense at depth 5."""
        return (0, 1, 5)

    def for_graft(self, levels: int, total_tokens: int) -> Eagle3Config:
        """``depth = max(1, levels - 1)`` expansions, ``total_tokens`` capped at the pool + 1."""
        depth = max(1, levels - 1)
        pool = self.top_k + depth * self.top_k**2
        return dataclasses.replace(self, depth=depth, total_tokens=min(total_tokens, pool + 1))


@dataclass(frozen=True)
class SpecBlockConfig:
    """Knobs of the SpecBlock block drafter (docs/algorithms.md §4; ``drafters/specblock.py``).

    One drafter forward emits ``block_size`` dependent positions. Block 1 drafts a greedy chain at
    the root; the rank head's class per slot sets how many alternatives branch there
    (``slot_widths[class]``; the give-up class stops the chain there); the best ``beam`` pending
    leaves then seed up to ``max_blocks - 1`` further blocks (one forward each). The pool is
    reranked by cumulative log-probability to ``total_tokens - 1`` draft nodes.
    """

    AUTO = "auto"
    RANDOM = "random"
    RANK_CLASSES = 4
    MAX_BLOCKS = 8
    GRAFT_SIZED = {"total_tokens": 2, "max_blocks": 1}
    """Fields Graft sets (:class:`StagedTreeConfig`), at their smallest valid values."""

    total_tokens: int = 48
    """Verified tree size, root included. Range [2, 1024]."""
    block_size: int = 4
    """K': slots drafted per block, at most the checkpoint's K (a ``random`` head is built with
    K = K'). K' < K is exact: every anchor still encodes all K slots into the cross cache (the
    context training exposed), and a block keeps its first K' slots (slot k depends only on
    slots <= k of its own block). Range [1, 16]."""
    max_blocks: int = 2
    """Block expansions per step (drafter forwards after encoding, at most). Range [1, 8]."""
    beam: int = 8
    """Pending leaves kept per block, and the root slot's width. Range [1, 64]."""
    slot_widths: tuple[int, ...] = (2, 4, 6, 0)
    """Tokens drafted at a slot per rank class (continue, branch-few, branch-many, give-up);
    1 = greedy only, 0 = stop the chain at that slot (no token there, nothing below it). The
    give-up entry is 0 by default, so the class gives up; a positive value makes it branch like
    the others (the reference's ``slim_r2`` [2, 4, 6, 4] never gives up). Four entries, each in
    [0, 64]; the continue entry >= 1."""
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
        _check_int(o, "max_blocks", self.max_blocks, 1, self.MAX_BLOCKS)
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

    def verify_curve_size(self) -> int:
        """0: the tree size is configured; no measured verify curve c(T) is needed."""
        return 0

    # ------------------------------------------------------------------ as Graft's tree drafter
    @property
    def level_step(self) -> int:
        """A forward drafts a block: ``block_size`` levels."""
        return self.block_size

    @property
    def max_levels(self) -> int:
        """``MAX_BLOCKS`` blocks of ``block_size`` levels."""
        return self.MAX_BLOCKS * self.block_size

    @property
    def first_level_width(self) -> int:
        """Block 1's slot 0 holds the ``beam`` best tokens."""
        return self.beam

    def graft_stages(self) -> tuple[int, ...]:
        """Prune after block 1, dense after block 2."""
        return (0, self.block_size, 2 * self.block_size)

    def for_graft(self, levels: int, total_tokens: int) -> SpecBlockConfig:
        """``max_blocks = max(1, levels // block_size)``, trees of ``total_tokens``."""
        return dataclasses.replace(self, max_blocks=max(1, levels // self.block_size), total_tokens=total_tokens)


TREE_DRAFTER_CONFIGS: dict[str, type] = {"eagle3": Eagle3Config, "specblock": SpecBlockConfig}
"""Graft's tree drafter types (``graft.tree_drafter.type``) and their configs (:class:`StagedTreeConfig`)."""


@dataclass(frozen=True)
class BatchConfig:
    """Continuous batching (:class:`speculation.engine.batch.BatchEngine`): KV slots and the step budget.

    Memory is bounded up front: the KV pool holds ``max_sequences`` slots of
    ``max_tokens_per_sequence`` rows each (per layer ``2 * S * L * kv_heads * head_dim`` values).
    A request needs ``len(prompt) + max_new_tokens <= max_tokens_per_sequence``; one that never
    fits is refused at ``add``; one that fits waits for a free slot. Live sequences are never
    evicted; a draft tree is cut (best nodes first) to the rows left in its slot.

    With ``kv_token_budget`` the slots are sized per request instead
    (:class:`~speculation.model.kv_slots.SizedKVSlotPool`): a request's slot holds
    ``min(max_tokens_per_sequence, len(prompt) + max_new_tokens + max_tree_tokens)`` rows, and a
    waiting request is admitted while the live slots' rows sum to at most the budget, so memory
    follows the contexts actually served, not ``S * L``.
    """

    max_sequences: int = 8
    """Live sequences (KV slots) verified together in one forward. Range [1, 1024]."""
    max_tokens_per_sequence: int = 1024
    """KV rows per slot: prompt + generated tokens + the tree being verified. Range [2, 1048576]."""
    max_tree_tokens: int = 64
    """Largest tree (root included) one sequence may verify per step. Range [1, 4096]."""
    kv_token_budget: int | None = None
    """KV rows held by all live slots together when slots are sized per request (in process
    only; the Ray shards keep fixed slots). None = fixed slots of ``max_tokens_per_sequence`` rows,
    allocated at once. Range [2, 1048576 * 1024]."""
    step_token_budget: int | None = None
    """Tree tokens (roots included) verified per step over the whole batch; None = no batch cap
    (each sequence gets ``max_tree_tokens``). Must be >= max_sequences (every live sequence
    verifies at least its root). Range [max_sequences, 1048576]."""
    goodput: bool = False
    """Split the step's tree-token budget across sequences with the goodput rule
    (:mod:`speculation.policy.goodput`) instead of giving every sequence its full tree."""
    payoff_veto: bool = False
    """With ``goodput``: sit out the steps the rule would draft while the engine's drafted steps
    have realised fewer tokens per second than its plain ones
    (:class:`~speculation.policy.goodput.RealisedPayoff`), re-testing at doubling spacing. Off by
    default: in two interleaved A/Bs (bf16, retrieval, N = 4 and 8) it won 5 of 6 pairs, then
    4 of 8 with a median of 0.96x at N = 4, where it kept out drafting that paid
    (``benchmarks/results/payoff_veto_bf16.json``)."""
    max_waiting: int = 4096
    """Requests queued for a slot beyond the free ones (a request that a free slot will take at the
    next step does not count); ``add`` refuses more. Range [0, 1048576]."""
    fold_prefills: bool = True
    """Prefill arriving requests inside the step's batched forward (one more causal row of the
    flat pass) where the target supports it (``TargetModel.folds_prefills``: the FLAT layout),
    instead of one forward per arriving prompt before the step. The outputs are the same bits
    either way (tested); False is the A/B baseline."""
    prefill_chunk_tokens: int | None = None
    """Chunked prefill: an arriving prompt longer than this is prefilled over several steps, one
    chunk of this many tokens per step (tokens ``jC .. (j+1)C - 1`` at step j, whatever else the
    step holds), so one long prompt no longer stalls every live sequence for its whole prefill
    (vLLM's chunked prefill bounds it the same way). The chunk boundaries depend only on the prompt,
    so each sequence's output equals the solo loop's with ``engine.prefill_chunk_tokens`` equal to
    this bit for bit; against an unchunked prefill it equals up to summation order. Needs
    ``fold_prefills`` and a target that ``folds_prefills`` (the FLAT layout, in process or over
    Ray shards: a chunk is a prefill row over its slot's earlier chunks). None = a prompt is prefilled in one step. Range [1, 1048576]."""
    prefill_step_tokens: int | None = None
    """With chunked prefill: the most prompt tokens one step prefills over all arriving prompts
    (vLLM's ``max_num_batched_tokens`` for the prefill share). A chunk that does not fit waits for
    a later step, and no new request is admitted past the budget, but every step with prompts
    under way prefills at least one chunk. The chunk boundaries do not move, so outputs are the
    same bits. None = every arriving prompt advances one chunk per step. Range
    [prefill_chunk_tokens, 1048576]."""

    def __post_init__(self) -> None:
        o = "batch"
        _check_int(o, "max_sequences", self.max_sequences, 1, 1024)
        _check_int(o, "max_tokens_per_sequence", self.max_tokens_per_sequence, 2, 1 << 20)
        _check_int(o, "max_tree_tokens", self.max_tree_tokens, 1, 4096)
        if self.kv_token_budget is not None:
            _check_int(o, "kv_token_budget", self.kv_token_budget, 2, 1 << 30)
        if self.step_token_budget is not None:
            _check_int(o, "step_token_budget", self.step_token_budget, self.max_sequences, 1 << 20)
        if not isinstance(self.goodput, bool):
            raise ConfigError(f"{o}.goodput must be true or false, got {self.goodput!r}")
        if not isinstance(self.payoff_veto, bool):
            raise ConfigError(f"{o}.payoff_veto must be true or false, got {self.payoff_veto!r}")
        _check_int(o, "max_waiting", self.max_waiting, 0, 1 << 20)
        if not isinstance(self.fold_prefills, bool):
            raise ConfigError(f"{o}.fold_prefills must be true or false, got {self.fold_prefills!r}")
        if self.prefill_chunk_tokens is not None:
            _check_int(o, "prefill_chunk_tokens", self.prefill_chunk_tokens, 1, 1 << 20)
            if not self.fold_prefills:
                raise ConfigError(f"{o}.prefill_chunk_tokens needs {o}.fold_prefills true (a chunk rides in a "
                                  f"step's forward), got fold_prefills false")
        if self.prefill_step_tokens is not None:
            if self.prefill_chunk_tokens is None:
                raise ConfigError(f"{o}.prefill_step_tokens needs {o}.prefill_chunk_tokens (it budgets the chunks)")
            _check_int(o, "prefill_step_tokens", self.prefill_step_tokens, self.prefill_chunk_tokens, 1 << 20)
