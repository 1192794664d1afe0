"""The sweep config (``ray_configs/sweep_<name>.yaml``): validated on load, paths made absolute.

A Ray job runs in a temporary copy of the working directory, so every path a sweep writes to
(Optuna storage, MLflow store and artifacts, Tune's storage) is resolved against ``--root``
(the submitting checkout: pass ``--root $PWD``) before anything runs.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import tracking
from speculation.config import BenchConfig, ConfigError, from_dict, to_dict
from sweeps.space import SearchSpace, build_space


class Objective(str, enum.Enum):
    """What a sweep optimises."""

    SPEEDUP = "speedup"
    """Maximise the measured speedup over vanilla."""
    SPEEDUP_VS_DRAFTING = "speedup_vs_drafting"
    """Multi-objective: maximise speedup, minimise drafting share (a Pareto front)."""

    @property
    def metrics(self) -> list[str]:
        return ["speedup"] if self == Objective.SPEEDUP else ["speedup", "drafting_share"]

    @property
    def modes(self) -> list[str]:
        return ["max"] if self == Objective.SPEEDUP else ["max", "min"]

    @property
    def directions(self) -> list[str]:
        return ["maximize" if m == "max" else "minimize" for m in self.modes]


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


@dataclass(frozen=True)
class SweepConfig:
    """One Optuna study over one method's knobs, each trial a bench run."""

    study: str
    """Study name (Optuna study, Tune run and MLflow parent run). Letters, digits, ``_.-``."""
    method: str
    """The drafter type whose config dataclass defines the knobs (``retrieval`` …)."""
    space: Mapping[str, Any]
    """Searched knobs: name -> ``{type: int|float|categorical, low, high, log, step, choices}``."""
    fixed: Mapping[str, Any] = field(default_factory=dict)
    """Knobs held fixed in every trial."""
    trials: int = 20
    """Finished trials the study should hold (a resumed study runs only the rest). Range [1, 100000]."""
    concurrency: int = 1
    """Trials running at once. Range [1, 1024]."""
    objective: Objective = Objective.SPEEDUP
    seed: int = 0
    """Sampler seed (a resumed study offsets it by the trials already held)."""
    bench: Mapping[str, Any] = field(default_factory=dict)
    """``BenchConfig`` fields for every trial (``methods`` is set by the sweep)."""
    categories: tuple[str, ...] | None = None
    """Only these question categories (None = all of the dataset)."""
    holdout_categories: tuple[str, ...] | None = None
    """Categories the sweep never sees: once the study is done, the best trial's configuration is
    benched on them (one run, kind ``sweep_holdout``) and its held-out speedup is reported beside
    its sweep score. Needs ``categories``, and must not overlap them (None = no held-out run)."""
    trial_resources: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1})
    """Ray resources per trial."""
    storage: str | None = None
    """Optuna RDB storage URL (any SQLAlchemy URL). Default ``sqlite:///<root>/runs/sweeps/optuna.db``."""
    tracking_uri: str | None = None
    """MLflow tracking URI. Default: ``--tracking-uri``, else ``MLFLOW_TRACKING_URI``, else
    ``sqlite:///<root>/mlflow.db`` (``--tracking-uri`` overrides this field too). On a cluster of
    more than one node it must be a server every node reaches (``http://HEAD:5000``)."""
    experiment: str | None = None
    """MLflow experiment name. Default ``graftblock-sweep-<study>``."""
    output_dir: str | None = None
    """Trial artifacts and the comparison. Default ``<root>/runs/sweeps/<study>``."""
    tune_storage: str | None = None
    """Ray Tune's ``storage_path``: a directory (relative to ``--root``) or a URI every node
    reaches (``s3://bucket/path``, ``gs://…``). Default ``<output_dir>``."""
    shared_filesystem: bool = False
    """Declare that ``tune_storage`` (a directory) is on a filesystem every node mounts (NFS …);
    without it a directory is refused on a cluster of more than one node."""
    retries: int = 1
    """Times Tune restarts a trial that raised or whose actor died (the retry reuses the trial's
    MLflow run). Range [0, 10]."""

    def __post_init__(self) -> None:
        o = "sweep"
        if not isinstance(self.study, str) or not _NAME.match(self.study):
            raise ConfigError(
                f"{o}.study must be 1-100 letters, digits or _.- (starting alphanumeric), got {self.study!r}"
            )
        for name, lo, hi in (("trials", 1, 100000), ("concurrency", 1, 1024), ("retries", 0, 10)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"{o}.{name} must be an integer in [{lo}, {hi}], got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"{o}.seed must be an integer >= 0, got {self.seed!r}")
        try:
            object.__setattr__(self, "objective", Objective(self.objective))
        except ValueError:
            allowed = ", ".join(x.value for x in Objective)
            raise ConfigError(f"{o}.objective must be one of {allowed}, got {self.objective!r}") from None
        if not isinstance(self.bench, Mapping):
            raise ConfigError(f"{o}.bench must be a mapping of BenchConfig fields, got {self.bench!r}")
        if "methods" in self.bench:
            raise ConfigError(f"{o}.bench.methods is set by the sweep (sweep.method); remove it")
        if self.categories is not None:
            if (
                not isinstance(self.categories, (list, tuple))
                or not all(isinstance(c, str) for c in self.categories)
                or not self.categories
            ):
                raise ConfigError(
                    f"{o}.categories must be a non-empty list of category names, got {self.categories!r}"
                )
            object.__setattr__(self, "categories", tuple(self.categories))
        if self.holdout_categories is not None:
            held = self.holdout_categories
            if not isinstance(held, (list, tuple)) or not held or not all(isinstance(c, str) for c in held):
                raise ConfigError(
                    f"{o}.holdout_categories must be a non-empty list of category names, got {held!r}"
                )
            if self.categories is None:
                raise ConfigError(
                    f"{o}.holdout_categories needs {o}.categories (the subset the sweep tunes on); "
                    "without it every category is in the sweep and none is held out"
                )
            overlap = sorted(set(held) & set(self.categories))
            if overlap:
                raise ConfigError(f"{o}.holdout_categories {overlap} are also in {o}.categories; held-out "
                                  "categories must be ones the sweep never sees")
            object.__setattr__(self, "holdout_categories", tuple(held))
        res = self.trial_resources
        if (
            not isinstance(res, Mapping)
            or not res
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in res.values())
        ):
            raise ConfigError(f"{o}.trial_resources must map Ray resource names to amounts >= 0, got {res!r}")
        if not isinstance(self.shared_filesystem, bool):
            raise ConfigError(f"{o}.shared_filesystem must be true or false, got {self.shared_filesystem!r}")
        for name in ("storage", "tracking_uri", "experiment", "output_dir", "tune_storage"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ConfigError(f"{o}.{name} must be a non-empty string or null, got {v!r}")
        self.search_space()  # validates method, knobs and fixed values
        self.bench_config()

    # ------------------------------------------------------------------ derived
    def search_space(self) -> SearchSpace:
        return build_space(self.method, self.space, self.fixed)

    def bench_config(self) -> BenchConfig:
        # dtype as a string: DType.parse does not accept a DType member (str() of it is "DType.X").
        data = {"dtype": BenchConfig.dtype.value, **self.bench, "methods": (self.method,)}
        return from_dict(BenchConfig, data, where="sweep.bench")

    def resolved(self, root: str | Path, tracking_uri: str | None = None) -> "ResolvedPaths":
        """Absolute locations of everything the sweep writes, relative paths taken from ``root``.

        The tracking URI: ``tracking_uri`` (``--tracking-uri``), else the config's, else
        ``MLFLOW_TRACKING_URI``, else ``sqlite:///<root>/mlflow.db`` (see
        :func:`tracking.resolve_uri`).
        """
        root = Path(root).expanduser().resolve()
        out = _abs_path(self.output_dir, root) if self.output_dir else root / "runs" / "sweeps" / self.study
        storage = (
            _abs_sqlite(self.storage, root)
            if self.storage
            else f"sqlite:///{root / 'runs' / 'sweeps' / 'optuna.db'}"
        )
        uri = _abs_sqlite(tracking.resolve_uri(tracking_uri or self.tracking_uri, default_dir=root), root)
        if self.tune_storage is None:
            tune_storage = str(out)
        elif tune_storage_is_uri(self.tune_storage):
            tune_storage = self.tune_storage
        else:
            tune_storage = str(_abs_path(self.tune_storage, root))
        return ResolvedPaths(
            root=root,
            output_dir=out,
            storage=storage,
            tracking_uri=uri,
            experiment=self.experiment or f"graftblock-sweep-{self.study}",
            artifact_location=str(
                root / "mlartifacts" / (self.experiment or f"graftblock-sweep-{self.study}")
            ),
            tune_storage=tune_storage,
            shared_filesystem=self.shared_filesystem,
        )

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, enum.Enum):
                v = v.value
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, Mapping):
                v = dict(v)
            out[f.name] = v
        out["bench"] = to_dict(self.bench_config())
        return out


@dataclass(frozen=True)
class ResolvedPaths:
    """Absolute locations for one sweep."""

    root: Path
    output_dir: Path
    storage: str
    tracking_uri: str
    experiment: str
    artifact_location: str
    """MLflow artifact root for experiments this sweep creates (sqlite stores)."""
    tune_storage: str
    """Ray Tune's ``storage_path`` (an absolute directory or a URI)."""
    shared_filesystem: bool
    """``tune_storage`` (a directory) is mounted on every node."""

    @property
    def artifacts_dir(self) -> Path:
        return self.output_dir / "artifacts"


def check_cluster(alive_nodes: int, paths: ResolvedPaths) -> None:
    """Refuse, naming the fix, what only works on one machine when the Ray cluster has more nodes.

    Trials run on any node: each logs to the tracking store and writes to Tune's storage from
    there. A sqlite (or file) tracking store and a local Tune directory live on one machine only.
    ``alive_nodes`` is the count of alive nodes in ``ray.nodes()``.
    """
    if alive_nodes <= 1:
        return
    where = f"the Ray cluster has {alive_nodes} nodes and trials run on any of them"
    if tracking.store_kind(paths.tracking_uri) == tracking.StoreKind.FILE:
        raise ConfigError(
            f"sweep: {where}, but the tracking store {paths.tracking_uri} is a file on one machine; "
            "use an mlflow server URI (--tracking-uri http://HEAD:5000, or tracking_uri: in the sweep "
            "YAML; ray_configs/cluster.yaml starts one on the head)"
        )
    if not tune_storage_is_uri(paths.tune_storage) and not paths.shared_filesystem:
        raise ConfigError(
            f"sweep: {where}, but Tune's storage_path {paths.tune_storage} is a local directory; set "
            "tune_storage: to a URI every node reaches (s3://bucket/path, gs://...) or to a directory "
            "every node mounts and declare it with shared_filesystem: true"
        )


def tune_storage_is_uri(p: str) -> bool:
    """``scheme://...`` other than ``file://`` (a remote filesystem Tune reaches through pyarrow)."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", p) is not None and not p.startswith("file://")


def _abs_path(p: str, root: Path) -> Path:
    path = Path(p).expanduser()
    return path if path.is_absolute() else (root / path).resolve()


def _abs_sqlite(url: str, root: Path) -> str:
    """``sqlite:///rel.db`` -> ``sqlite:////<root>/rel.db``; other URLs unchanged."""
    prefix = "sqlite:///"
    if url.startswith(prefix):
        rest = url[len(prefix) :]
        if rest and not rest.startswith("/") and rest != ":memory:":
            return prefix + str((root / rest).resolve())
    return url


def load_sweep_config(path: str | Path) -> SweepConfig:
    """Read and validate a sweep YAML file."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--config: no such file {str(path)!r}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"sweep config {path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"sweep config {path}: expected a mapping at the top level")
    for key in ("study", "method", "space"):
        if key not in data:
            raise ConfigError(f"sweep config {path}: missing required key {key!r}")
    return from_dict(SweepConfig, data, where=f"sweep ({p.name})")
