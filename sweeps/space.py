"""Search spaces declared in YAML, validated against the method's own config dataclass.

A sweep tunes one *method* (a drafter type: ``retrieval``, later ``graft``, ``specblock`` …).
The method's config dataclass in ``speculation/config.py`` (``RetrievalConfig`` …) defines
which knobs exist: a knob that is not one of its fields is an error naming it and listing the
valid ones, so new methods become sweepable by adding their config class, nothing else::

    space:
      budget:          {type: int, low: 4, high: 64, log: true}
      max_depth:       {type: int, low: 2, high: 16}
      min_token_prob:  {type: float, low: 0.01, high: 0.2, log: true}
      transition_topk: {type: categorical, choices: [0, 2, 4, 8]}
    fixed:
      cost_aware: false

Every value a knob can take at the ends of its range (each choice; low and high) is checked by
building the config with it, so an out-of-range space fails before any trial runs.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from speculation.config import ConfigError, from_dict
from speculation.drafters import DrafterType, MethodSpec, resolve_methods


class KnobKind(str, enum.Enum):
    """How a knob is sampled."""

    INT = "int"
    FLOAT = "float"
    CATEGORICAL = "categorical"


_SCALAR = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class Knob:
    """One searched knob.

    Attributes:
        name: a field of the method's config dataclass.
        kind: int / float / categorical.
        low, high: inclusive range (int, float).
        log: sample on a log scale (int, float; needs low > 0).
        step: grid step (int only; default 1).
        choices: the values (categorical).
    """

    name: str
    kind: KnobKind
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: int | None = None
    choices: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        where = f"sweep.space.{self.name}"
        if self.kind == KnobKind.CATEGORICAL:
            if not self.choices:
                raise ConfigError(f"{where}: categorical knob needs a non-empty 'choices' list")
            bad = [c for c in self.choices if not _is_choice(c)]
            if bad:
                raise ConfigError(
                    f"{where}: choices must be scalars (int, float, str, bool, null) or lists of scalars "
                    f"(e.g. graft stages [0, 1, 5]), got {bad}"
                )
            object.__setattr__(self, "choices", tuple(tuple(c) if isinstance(c, list) else c for c in self.choices))
            if self.low is not None or self.high is not None or self.log or self.step is not None:
                raise ConfigError(f"{where}: categorical knob takes only 'choices'")
            return
        if self.choices:
            raise ConfigError(f"{where}: 'choices' is only for type: categorical")
        for end in ("low", "high"):
            v = getattr(self, end)
            if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(float(v)):
                raise ConfigError(f"{where}.{end} must be a number, got {v!r}")
            if self.kind == KnobKind.INT and not isinstance(v, int):
                raise ConfigError(f"{where}.{end} must be an integer for type: int, got {v!r}")
        if self.low > self.high:
            raise ConfigError(f"{where}: low ({self.low}) must be <= high ({self.high})")
        if self.log and self.low <= 0:
            raise ConfigError(f"{where}: log: true needs low > 0, got {self.low}")
        if self.step is not None:
            if self.kind != KnobKind.INT:
                raise ConfigError(f"{where}.step is only for type: int")
            if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 1:
                raise ConfigError(f"{where}.step must be an integer >= 1, got {self.step!r}")
            if self.log and self.step != 1:
                raise ConfigError(f"{where}: log: true needs step 1")

    def probe_values(self) -> list[Any]:
        """Values to validate the knob with: every choice, or the two ends of the range."""
        return list(self.choices) if self.kind == KnobKind.CATEGORICAL else [self.low, self.high]

    def suggest(self, trial) -> Any:
        """Sample the knob with an Optuna trial (define-by-run)."""
        if self.kind == KnobKind.INT:
            return trial.suggest_int(
                self.name, int(self.low), int(self.high), step=self.step or 1, log=self.log
            )
        if self.kind == KnobKind.FLOAT:
            return trial.suggest_float(self.name, float(self.low), float(self.high), log=self.log)
        if any(isinstance(c, tuple) for c in self.choices):
            # Optuna stores scalar choices only: a list choice is stored as its label "[0, 1, 5]".
            labels = {_label(c): c for c in self.choices}
            return labels[trial.suggest_categorical(self.name, list(labels))]
        return trial.suggest_categorical(self.name, list(self.choices))


def _is_choice(c: Any) -> bool:
    return isinstance(c, _SCALAR) or (isinstance(c, (list, tuple)) and all(isinstance(x, _SCALAR) for x in c))


def _label(c: Any) -> Any:
    return f"[{', '.join(str(x) for x in c)}]" if isinstance(c, tuple) else c


_KNOB_KEYS = {"type", "low", "high", "log", "step", "choices"}


def parse_knob(name: str, raw: Any) -> Knob:
    """A :class:`Knob` from its YAML mapping (clear errors for malformed entries)."""
    where = f"sweep.space.{name}"
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{where}: expected a mapping like {{type: int, low: 1, high: 8}} or "
            f"{{type: categorical, choices: [...]}}, got {raw!r}"
        )
    unknown = sorted(set(raw) - _KNOB_KEYS, key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_KNOB_KEYS)}")
    try:
        kind = KnobKind(raw.get("type"))
    except ValueError:
        allowed = ", ".join(k.value for k in KnobKind)
        raise ConfigError(f"{where}.type must be one of {allowed}, got {raw.get('type')!r}") from None
    choices = raw.get("choices", ())
    if not isinstance(choices, (list, tuple)):
        raise ConfigError(f"{where}.choices must be a list, got {choices!r}")
    log = raw.get("log", False)
    if not isinstance(log, bool):
        raise ConfigError(f"{where}.log must be true or false, got {log!r}")
    return Knob(
        name=name,
        kind=kind,
        low=raw.get("low"),
        high=raw.get("high"),
        log=log,
        step=raw.get("step"),
        choices=tuple(choices),
    )


@dataclass(frozen=True)
class SearchSpace:
    """The knobs of one method: searched ones and fixed ones.

    Attributes:
        method: the method's spec with its default config (its type decides the valid knobs).
        knobs: searched knobs, in declaration order.
        fixed: knobs held at a value in every trial.
    """

    method: MethodSpec
    knobs: tuple[Knob, ...]
    fixed: dict[str, Any]

    @property
    def config_class(self) -> type:
        return type(self.method.config)

    def valid_knobs(self) -> list[str]:
        return sorted(f.name for f in dataclasses.fields(self.config_class) if f.init)

    def options(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The method's options for one point: ``fixed``, then ``params`` as Optuna stored them.

        A list choice comes back from Optuna as its label (``"[0, 1, 5]"``) and is mapped back to
        the list. A dotted knob (``tree_drafter.block_size``) sets one key of a nested section: the
        section is taken from ``fixed`` when it is there, else from the method's default.
        """
        labels = {k.name: {_label(c): c for c in k.choices} for k in self.knobs if k.kind == KnobKind.CATEGORICAL}
        out: dict[str, Any] = dict(self.fixed)
        for name, value in params.items():
            if isinstance(value, str):
                value = labels.get(name, {}).get(value, value)
            head, _, key = name.partition(".")
            if not key:
                out[name] = value
                continue
            section = out.get(head, getattr(self.method.config, head))
            out[head] = {**dict(section), key: value}
        return out

    def resolve(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The full method config (defaults, then fixed, then ``params``) as a plain dict."""
        cfg = from_dict(self.config_class, self.options(params), where=f"sweep.{self.method.name}")
        return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}

    def define_by_run(self, trial) -> dict[str, Any]:
        """Optuna define-by-run space; also hands the trial number to the trainable."""
        for knob in self.knobs:
            knob.suggest(trial)
        return {"_trial_number": trial.number}


def build_space(
    method: str, space: Mapping[str, Any] | None, fixed: Mapping[str, Any] | None = None
) -> SearchSpace:
    """Validate ``space`` and ``fixed`` against ``method``'s config dataclass."""
    if not isinstance(method, str) or not method:
        raise ConfigError(f"sweep.method must name a drafter type, got {method!r}")
    spec = resolve_methods([method], {})[0]
    if spec.type == DrafterType.VANILLA or spec.config is None:
        allowed = ", ".join(t.value for t in DrafterType if t != DrafterType.VANILLA)
        raise ConfigError(f"sweep.method {method!r} has no knobs to search; sweepable methods: {allowed}")
    if space is None or not isinstance(space, Mapping) or not space:
        raise ConfigError("sweep.space must be a non-empty mapping of knob name -> {type: ..., ...}")
    if fixed is not None and not isinstance(fixed, Mapping):
        raise ConfigError(f"sweep.fixed must be a mapping of knob -> value, got {fixed!r}")
    fixed = dict(fixed or {})
    cfg_cls = type(spec.config)
    valid = sorted(f.name for f in dataclasses.fields(cfg_cls) if f.init)
    for section, names in (("space", list(space)), ("fixed", list(fixed))):
        # A searched knob may be dotted (``tree_drafter.block_size``): one key of a nested section.
        heads = [n.partition(".")[0] if section == "space" else n for n in names]
        unknown = [n for n, h in zip(names, heads) if h not in valid]
        if unknown:
            raise ConfigError(
                f"sweep.{section}: unknown knob(s) {unknown} for method {method!r} ({cfg_cls.__name__}); "
                f"valid knobs: {valid}"
            )
    both = sorted(set(space) & set(fixed))
    if both:
        raise ConfigError(f"sweep: knob(s) {both} are both searched (space) and fixed; keep one")
    for name in space:
        head, _, key = name.partition(".")
        if key and not isinstance(fixed.get(head, getattr(spec.config, head)), Mapping):
            raise ConfigError(
                f"sweep.space.{name}: {head!r} is not a nested section of {cfg_cls.__name__} "
                f"(only mapping-valued knobs such as graft's tree_drafter take dotted keys)"
            )
    knobs = tuple(parse_knob(name, raw) for name, raw in space.items())
    out = SearchSpace(method=spec, knobs=knobs, fixed=fixed)
    out.resolve({})  # fixed values alone must be valid
    for knob in knobs:
        for value in knob.probe_values():
            try:
                out.resolve({knob.name: value})
            except ConfigError as exc:
                raise ConfigError(f"sweep.space.{knob.name}: value {value!r} is invalid: {exc}") from None
    return out
