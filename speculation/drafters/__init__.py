"""Drafters behind one protocol, and the registry that builds them by method name.

A *method* is a name plus a drafter type plus that drafter's validated config. The bench and the
sweeps refer to methods by name; a YAML config may define variants::

    retrieval:            {budget: 24}
    retrieval_small:      {type: retrieval, budget: 8}
    graft:                {stages: [0, 1, 5], threshold: 0.3, graft_budget: 16}
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from speculation.config import (
    ConfigError,
    Eagle3Config,
    GraftConfig,
    RetrievalConfig,
    SpecBlockConfig,
    from_dict,
    to_dict,
)
from speculation.policy.cost import VerifyCost, measure_cost_model
from speculation.drafters.base import DraftContext, Drafter, Proposal, Reportable, StepOutcome, WeightSwappable
from speculation.drafters.eagle3 import build_eagle3_drafter
from speculation.drafters.graft import build_graft_drafter
from speculation.drafters.retrieval import RetrievalDrafter, new_store
from speculation.drafters.suffix_store import SuffixStore
from speculation.drafters.specblock import build_specblock_drafter

__all__ = [
    "DraftContext",
    "Drafter",
    "DrafterType",
    "MethodSpec",
    "Proposal",
    "Reportable",
    "StepOutcome",
    "WeightSwappable",
    "build_drafter",
    "drafter_factory",
    "resolve_methods",
]


class DrafterType(str, enum.Enum):
    """Known drafter types. ``VANILLA`` means no drafter (the baseline loop)."""

    VANILLA = "vanilla"
    RETRIEVAL = "retrieval"
    EAGLE3 = "eagle3"
    SPECBLOCK = "specblock"
    GRAFT = "graft"


BUILTIN_VARIANTS: dict[str, Mapping[str, Any]] = {
    "graft_specblock": {"type": "graft", "tree_drafter": {"type": "specblock"}},  # Graft over SpecBlock
    # Retrieval plus the cross-request suffix store (SuffixDecoding): earlier outputs, 1M tokens.
    "retrieval_store": {"type": "retrieval", "store_tokens": 1_000_000},
}
"""Method names usable without ``--config``: a type plus options (a config section overrides them)."""

DrafterBuilder = Callable[[Any, Any, VerifyCost | None], Drafter]
"""``build(config, target, cost_model) -> drafter``: every drafter type's builder."""


def build_retrieval_drafter(config: RetrievalConfig, target: Any, cost_model: VerifyCost | None,
                            store: SuffixStore | None = None) -> RetrievalDrafter:
    """A :class:`RetrievalDrafter` for ``target`` (reads only ``target.vocab_size``)."""
    return RetrievalDrafter(config, target.vocab_size, cost_model, store)


@dataclass(frozen=True)
class DrafterEntry:
    """How a drafter type is configured and built: its config dataclass and its builder."""

    config: type
    build: DrafterBuilder


_REGISTRY: dict[DrafterType, DrafterEntry] = {
    DrafterType.RETRIEVAL: DrafterEntry(RetrievalConfig, build_retrieval_drafter),
    DrafterType.EAGLE3: DrafterEntry(Eagle3Config, build_eagle3_drafter),
    DrafterType.SPECBLOCK: DrafterEntry(SpecBlockConfig, build_specblock_drafter),
    DrafterType.GRAFT: DrafterEntry(GraftConfig, build_graft_drafter),
}
"""One row per drafter type (vanilla has none: it is the loop without a drafter)."""


@dataclass(frozen=True)
class MethodSpec:
    """A named, configured method."""

    name: str
    type: DrafterType
    config: Any  # the drafter's config dataclass, or None for vanilla

    def config_dict(self) -> dict:
        return to_dict(self.config) if self.config is not None else {}


def _parse_type(name: str, value: Any) -> DrafterType:
    try:
        return DrafterType(value)
    except ValueError:
        allowed = ", ".join(t.value for t in DrafterType)
        raise ConfigError(f"method {name!r}: unknown type {value!r}; allowed: {allowed}") from None


def resolve_methods(names: list[str], configs: Mapping[str, Mapping[str, Any]] | None = None) -> list[MethodSpec]:
    """Methods for ``names``; a name is a drafter type or a key of ``configs`` with a ``type``."""
    configs = dict(configs or {})
    specs = []
    for name in names:
        section = {**BUILTIN_VARIANTS.get(name, {}), **(configs.get(name) or {})}
        dtype = _parse_type(name, section.pop("type", name))
        entry = _REGISTRY.get(dtype)
        if entry is None:
            if section:
                raise ConfigError(f"method {name!r} ({dtype.value}) takes no options, got {sorted(section)}")
            cfg = None
        else:
            cfg = from_dict(entry.config, section, where=name)
        specs.append(MethodSpec(name=name, type=dtype, config=cfg))
    return specs


def build_drafter(spec: MethodSpec, target: Any, cost_model: VerifyCost | None = None) -> Drafter | None:
    """A fresh drafter for ``spec`` (None for vanilla).

    A drafter whose config needs a measured verify curve (``config.verify_curve_size() > 0``)
    gets ``cost_model``; when the caller passes none, c(T) is measured on ``target`` up to that
    size (once per target and size, see :func:`~speculation.policy.cost.measure_cost_model`). The
    distributed path measures over its actors and passes the model in.
    """
    if spec.type == DrafterType.VANILLA:
        return None
    size = spec.config.verify_curve_size()
    if size and cost_model is None:
        cost_model = measure_cost_model(target, max_size=size)
    return _REGISTRY[spec.type].build(spec.config, target, cost_model)


def drafter_factory(spec: MethodSpec, target: Any, cost_model: VerifyCost | None = None) -> Callable[[], Drafter] | None:
    """``factory() -> drafter`` building one fresh drafter per request, for an engine or a
    replica (None for vanilla).

    What the drafters of one engine share is made once here: the verify curve c(T) (measured on
    ``target`` now when needed and not given) and, for a retrieval method with
    ``store_tokens > 0``, one cross-request :class:`SuffixStore` that every drafter reads and
    every finished request feeds.
    """
    if spec.type == DrafterType.VANILLA:
        return None
    size = spec.config.verify_curve_size()
    if size and cost_model is None:
        cost_model = measure_cost_model(target, max_size=size)
    if spec.type == DrafterType.RETRIEVAL:
        store = new_store(spec.config)
        return lambda: build_retrieval_drafter(spec.config, target, cost_model, store)
    return lambda: _REGISTRY[spec.type].build(spec.config, target, cost_model)
