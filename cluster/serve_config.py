"""The serving configuration: one validated dataclass, loadable from YAML.

``ray_configs/serve_local.yaml`` is the embedded default (a local Ray instance on this machine);
``ray_configs/serve_cluster.yaml`` is the multi-node variant (replicas, an MLflow server). Every
field is documented below; errors name the field and the allowed range (:class:`ConfigError`).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


from speculation.config import ConfigError, DType, load_yaml_mapping, to_dict

#: The file that holds the embedded default serving config.
LOCAL_SERVE_CONFIG = Path(__file__).resolve().parent.parent / "ray_configs" / "serve_local.yaml"


def _int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"serve.{name} must be an integer in [{lo}, {hi}], got {value!r}")


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) is reachable only from this machine."""
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def _seconds(name: str, value: Any, hi: float = 86400.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(float(value)) \
            or not 0 < value <= hi:
        raise ConfigError(f"serve.{name} must be a number of seconds in (0, {hi}], got {value!r}")


class ProxyLocation(str, enum.Enum):
    """Where Ray Serve runs HTTP proxies (its ``proxy_location``)."""

    HEAD_ONLY = "HeadOnly"
    """One proxy, on the head node: one entry point (``host:port`` of the head)."""
    EVERY_NODE = "EveryNode"
    """A proxy on every node, each binding ``host:port`` (one node per machine only)."""


class DrafterPlacement(str, enum.Enum):
    """Where a replica's per-sequence drafters run (``serve.drafter_placement``)."""

    IN_PROCESS = "in_process"
    """In the replica's engine thread (no Ray calls on the step path)."""
    WORKER = "worker"
    """In one ``DrafterWorker`` actor per replica, through fault-tolerant proxies
    (``cluster.resilient_drafter``): a dead or hung worker costs speculation, never a token."""


LEARNER_POLICIES = ("static", "always", "periodic", "cost_aware")
"""Values of ``learner.policy`` (``adaptation.controller.Policy``)."""
GUARD_MODES = ("paired", "live")
"""Values of ``learner.guard_mode`` (``adaptation.rollback.GuardMode``; a test keeps them equal)."""


@dataclass(frozen=True)
class LearnerServeConfig:
    """The ``learner`` section: online adaptation inside the server (docs/algorithms.md §8).

    Only a learned feature drafter (``eagle3``, ``specblock``) can be adapted. With a method that
    is not learnable (``vanilla``, ``retrieval``, ``graft``) an enabled learner is a no-op: the
    replica logs one line saying so and starts no actor. The embedded default
    (``serve_local.yaml``) serves ``retrieval``, so there its learner is such a no-op.
    """

    enabled: bool = True
    """Run the learner (one shared named Ray actor per application) when the method is learnable."""
    policy: str = "cost_aware"
    """Update policy: static, always, periodic or cost_aware (the gated bandit)."""
    decide_every_steps: int = 64
    """Verify steps (feedback records) between decision rounds. Range [1, 1000000]."""
    horizon_s: float = 60.0
    """Gain horizon in seconds (N = request-rate EMA x horizon). Range (0, 86400]."""
    budgets: tuple[int, ...] = (0, 32, 128, 512)
    """Bandit arms: optimizer steps per update (0 = skip). Each in [0, 100000]."""
    fixed_budget: int = 32
    """Optimizer steps of an ``always`` update. Range [1, 100000]."""
    periodic_rounds: int = 4
    """Rounds between ``periodic`` updates. Range [1, 100000]."""
    periodic_budget: int = 128
    """Optimizer steps of a ``periodic`` update. Range [1, 100000]."""
    guard_window: int = 32
    """Verify steps the swap guard watches after an applied update. Range [1, 100000]."""
    guard_mode: str = "paired"
    """How the guard judges a swap: ``paired`` replays the previous and the new weights on the
    feedback served after the swap (same text), ``live`` compares live tau before and after it."""
    guard_margin: float = 0.1
    """Relative tau drop that rolls a swap back. Range [0, 1)."""
    lr: float = 3e-4
    """AdamW learning rate of an update. Range (0, 1]."""
    accepted_keep: float = 1.0
    """Share of accepted (non-mistake) positions in the update loss; mistakes are always in. Range [0, 1]."""
    recency_half_life: float | None = None
    """Requests back at which a buffered request's chance of being drawn for training halves, so a
    candidate after a domain shift trains mostly on the new domain. null = uniform. Range > 0."""
    heldout_sequences: int = 4
    """Most recent requests kept apart for the gain replay. Range [1, 10000]."""
    min_train_sequences: int = 1
    """Finished requests in the train part before any update. Range [1, 10000]."""
    min_train_positions: int = 0
    """Train positions (generated tokens with features) buffered before any update: with fewer, a
    candidate memorises its feedback. Range [0, 10000000]."""
    explore_budget: float | None = None
    """Share of serving wall time that candidates the gate refused may cost (training + replay);
    beyond it no new candidate is trained. null = unbounded. Range [0, 1]."""
    audit_window_steps: int | None = None
    """cost_aware: verify steps per audit window. When live tau drops from one window to the next
    by ``guard_margin`` while updated weights serve, the start and the live weights are replayed
    on that window and the start weights come back if the update is the cause. null = off.
    Range [2, 10000000]."""
    retry_growth: float = 2.0
    """The bandit re-tries an update budget once the train part holds this many times the positions
    of its latest estimate (``.inf`` = never). Range (1, inf]."""
    max_queue: int = 256
    """Feedback records queued on the replica; a record arriving at a full queue is dropped
    (counted in ``graftblock_learner_feedback_dropped``), decode never waits. Range [1, 1000000]."""
    batch_records: int = 32
    """Records per ``feed`` call to the learner. Range [1, 100000]."""
    max_inflight: int = 4
    """Outstanding ``feed`` calls per replica; batches beyond it are dropped. Range [1, 1024]."""
    num_cpus: float = 0.25
    """CPUs the learner actor reserves (a fraction: it must not pin serving cores). Range [0, 64]."""
    max_restarts: int = 3
    """Times Ray restarts a killed learner (it reloads its last published weights). Range [0, 1000]."""
    torch_threads: int = 1
    """torch intra-op threads in the learner actor. Range [1, 256]."""
    actor_name: str = "graftblock-learner"
    """Name of the shared learner actor (namespace ``graftblock``); replicas get or create it."""
    checkpoint_dir: str = "graftblock-learner"
    """Directory of the learner's drafter and its last published weights, which a restarted learner
    reloads (relative paths resolve against the working directory of the process that loads the
    config; on a multi-node cluster use a path every node sees). A new application starts from the
    configured drafter: the weights left there by an earlier application are cleared."""
    poll_interval_s: float = 1.0
    """Seconds between a replica's checks for newly published weights. Range (0, 3600]."""
    call_timeout_s: float = 10.0
    """Timeout of every ``ray.get`` on the learner (a hung learner costs updates, never requests).
    Range (0, 3600]."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"serve.learner.enabled must be true or false, got {self.enabled!r}")
        if self.policy not in LEARNER_POLICIES:
            raise ConfigError(f"serve.learner.policy must be one of {list(LEARNER_POLICIES)}, got {self.policy!r}")
        for name, hi in (("decide_every_steps", 1_000_000), ("fixed_budget", 100_000), ("periodic_rounds", 100_000),
                         ("periodic_budget", 100_000), ("guard_window", 100_000), ("heldout_sequences", 10_000),
                         ("min_train_sequences", 10_000), ("max_queue", 1_000_000), ("batch_records", 100_000),
                         ("max_inflight", 1024), ("torch_threads", 256)):
            _int(f"learner.{name}", getattr(self, name), 1, hi)
        _int("learner.max_restarts", self.max_restarts, 0, 1000)
        _int("learner.min_train_positions", self.min_train_positions, 0, 10_000_000)
        if isinstance(self.retry_growth, bool) or not isinstance(self.retry_growth, (int, float)) \
                or not self.retry_growth > 1:
            raise ConfigError(f"serve.learner.retry_growth must be a number > 1 (.inf = never), got {self.retry_growth!r}")
        budgets = tuple(self.budgets) if isinstance(self.budgets, (list, tuple)) else self.budgets
        if not isinstance(budgets, tuple) or not budgets:
            raise ConfigError(f"serve.learner.budgets must be a non-empty list of integers, got {self.budgets!r}")
        for b in budgets:
            _int("learner.budgets[]", b, 0, 100_000)
        object.__setattr__(self, "budgets", budgets)
        _seconds("learner.horizon_s", self.horizon_s)
        _seconds("learner.poll_interval_s", self.poll_interval_s, 3600.0)
        _seconds("learner.call_timeout_s", self.call_timeout_s, 3600.0)
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr <= 1:
            raise ConfigError(f"serve.learner.lr must be a number in (0, 1], got {self.lr!r}")
        if self.explore_budget is not None and (isinstance(self.explore_budget, bool)
                                                or not isinstance(self.explore_budget, (int, float))
                                                or not 0 <= self.explore_budget <= 1):
            raise ConfigError(f"serve.learner.explore_budget must be a number in [0, 1] or null, "
                              f"got {self.explore_budget!r}")
        a = self.audit_window_steps
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or not 2 <= a <= 10_000_000):
            raise ConfigError(f"serve.learner.audit_window_steps must be an integer in [2, 10000000] or null, got {a!r}")
        h = self.recency_half_life
        if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float)) or not h > 0):
            raise ConfigError(f"serve.learner.recency_half_life must be a number > 0 or null, got {h!r}")
        if self.guard_mode not in GUARD_MODES:
            raise ConfigError(f"serve.learner.guard_mode must be one of {list(GUARD_MODES)}, got {self.guard_mode!r}")
        if isinstance(self.guard_margin, bool) or not isinstance(self.guard_margin, (int, float)) \
                or not 0 <= self.guard_margin < 1:
            raise ConfigError(f"serve.learner.guard_margin must be a number in [0, 1), got {self.guard_margin!r}")
        if isinstance(self.accepted_keep, bool) or not isinstance(self.accepted_keep, (int, float)) \
                or not 0 <= self.accepted_keep <= 1:
            raise ConfigError(f"serve.learner.accepted_keep must be a number in [0, 1], got {self.accepted_keep!r}")
        if isinstance(self.num_cpus, bool) or not isinstance(self.num_cpus, (int, float)) \
                or not 0 <= self.num_cpus <= 64:
            raise ConfigError(f"serve.learner.num_cpus must be a number in [0, 64], got {self.num_cpus!r}")
        for name in ("actor_name", "checkpoint_dir"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ConfigError(f"serve.learner.{name} must be a non-empty string, got {getattr(self, name)!r}")
        # resolved where the config is loaded (the driver), so every replica and the learner agree
        object.__setattr__(self, "checkpoint_dir", str(Path(self.checkpoint_dir).expanduser().resolve()))


def learner_config_from_dict(data: Any) -> LearnerServeConfig:
    """:class:`LearnerServeConfig` from the ``learner`` mapping, rejecting unknown keys by name."""
    if isinstance(data, LearnerServeConfig):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"serve.learner must be a mapping of learner options, got {data!r}")
    names = {f.name for f in dataclasses.fields(LearnerServeConfig)}
    unknown = sorted(set(data) - names, key=str)
    if unknown:
        raise ConfigError(f"serve.learner: unknown key(s) {unknown}; allowed: {sorted(names)}")
    return LearnerServeConfig(**data)


@dataclass(frozen=True)
class ServeConfig:
    """One ``graftblock serve`` application: model, method, limits, placement, tracking."""

    model: str = "smollm2-135m"
    """Packaged alias, Hugging Face id or local model directory (loaded like ``graftblock generate``)."""
    served_model_name: str | None = None
    """The ``model`` name clients send and ``/v1/models`` lists; None = ``model``."""
    dtype: DType = DType.BFLOAT16
    """Target dtype: float32 (exact against the single-process twin) or bfloat16 (speed)."""
    method: str = "retrieval"
    """Decoding method: ``vanilla``, a drafter type (retrieval, eagle3, specblock, graft) or a key of
    ``methods`` (resolved by ``speculation.drafters.resolve_methods``)."""
    methods: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Method sections like ``graftblock bench --config``: name -> drafter options (``type`` optional)."""
    host: str = "127.0.0.1"
    """Address the HTTP proxy binds; loopback unless you mean to expose the server."""
    port: int = 8000
    """HTTP port. Range [1, 65535]."""
    proxy_location: ProxyLocation = ProxyLocation.HEAD_ONLY
    """``HeadOnly`` (one entry point on the head; replicas on any node) or ``EveryNode`` (a proxy per
    node, each binding ``port``: not for several nodes on one machine). :class:`ProxyLocation`."""
    api_key: str | None = None
    """If set, every /v1 request needs ``Authorization: Bearer <api_key>`` (401 otherwise)."""
    max_prompt_tokens: int = 2048
    """Longest prompt accepted, in tokens (a longer one gets a 400). Range [1, 1048576]."""
    max_tokens: int = 512
    """Largest ``max_tokens`` a request may ask for (400 above it). Range [1, 65536]."""
    default_max_tokens: int = 128
    """``max_tokens`` of a request that sets none. Range [1, max_tokens]."""
    max_sequences: int = 8
    """Sequences decoded together in one batch per replica (more wait in the queue). Range [1, 1024]."""
    max_waiting: int = 32
    """Requests a replica holds waiting for a free sequence; past it a request is refused at once with
    HTTP 429 and a ``Retry-After`` header instead of waiting. Range [0, 100000]."""
    retry_after_s: int = 1
    """``Retry-After`` seconds of a 429 (the admission queue is full). Range [1, 3600]."""
    batch: dict[str, Any] = field(default_factory=dict)
    """Further ``speculation.config.BatchConfig`` options (validated by it), e.g. a KV token budget."""
    request_timeout_s: float = 300.0
    """Longest a request may take end to end before it fails with a timeout error. Range (0, 86400]."""
    stall_timeout_s: float = 60.0
    """Longest the engine thread may spend in one step before the replica reports itself unhealthy
    and the waiting requests fail. Range (0, 86400]."""
    drain_timeout_s: float = 30.0
    """On shutdown, seconds in-flight requests get to finish before they are aborted. Range (0, 3600]."""
    torch_threads: int | None = None
    """torch intra-op threads in each replica. None keeps torch's default, which inside a Ray actor is
    Ray's ``OMP_NUM_THREADS``: the replica's CPU reservation (``replica_resources.CPU``, rounded
    down, at least 1), not the node's cores. Range [1, 256]."""
    num_replicas: int = 1
    """Ray Serve replicas, each with its own engine. Range [1, 1024]."""
    replica_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    """Ray resources per replica, e.g. ``{CPU: 1}`` here or ``{GPU: 1, CPU: 4}`` on a GPU node."""
    max_ongoing_requests: int = 64
    """Requests Ray Serve routes to one replica at a time (the rest queue in the proxy). Range [1, 100000]."""
    replica_retries: int = 2
    """Times the router re-sends a request whose engine replica was lost (node down, actor killed) before
    it answered; then the client gets a 503 OpenAI error body. Range [0, 10]."""
    drafter_placement: DrafterPlacement = DrafterPlacement.IN_PROCESS
    """``in_process`` or ``worker`` (:class:`DrafterPlacement`). Ignored for ``vanilla`` (no drafter)."""
    drafter_worker_cpus: float = 0.25
    """CPUs the drafter worker actor reserves (a fraction: it must not pin serving cores). Range [0, 64]."""
    drafter_worker_max_restarts: int = 10
    """Times Ray restarts a dead drafter worker; past that the replica creates a new one. Range [0, 1000]."""
    drafter_call_timeout_s: float = 5.0
    """Timeout of every ``ray.get`` on the drafter worker; past it the step runs without speculation and
    the worker is restarted. Range (0, 3600], below ``stall_timeout_s``."""
    drafter_restart_timeout_s: float = 60.0
    """Longest wait for Ray to restart a failed drafter worker before a new actor is created (sequences
    decode without speculation meanwhile). Range (0, 3600]."""
    target_shards: int = 0
    """Where a replica's target runs: 0 = in the replica's process; N >= 1 = N pipeline ``TargetShard``
    actors (contiguous layer ranges, placed by ``cluster.deploy.RayDeployment``) driven by
    ``cluster.batch_backend.RayBatchTarget``: one call per shard per engine step; a shard that Ray
    restarts gets its live sequences re-prefilled from their tokens and the step is retried. Only
    ``vanilla`` and ``retrieval`` run over shards (feature drafters need the target's weights in the
    replica). Range [0, 256], at most the model's layer count."""
    shard_cpus: float = 0.25
    """CPUs each shard actor reserves (a fraction is fine). Range (0, 64]."""
    shard_max_restarts: int = 3
    """Times Ray restarts a dead shard actor (each restart re-prefills its sequences); past that the
    requests in flight fail with a ``ShardLostError``. Range [0, 1000]."""
    shard_restart_timeout_s: float = 45.0
    """Longest an engine step waits for Ray to restart a dead shard (it reloads its layers). Range
    (0, 3600], below ``stall_timeout_s`` (the step blocks meanwhile)."""
    ray_address: str | None = None
    """Ray cluster to join (``auto``, ``ray://...``); None = start a local Ray instance."""
    ray_num_cpus: int | None = None
    """CPUs of the local Ray instance (only when ``ray_address`` is None; None = Ray's count)."""
    mlflow: bool = True
    """Log a serving run (resolved config as params, periodic metrics) to MLflow."""
    tracking_uri: str | None = None
    """MLflow tracking URI (None = ``MLFLOW_TRACKING_URI``, else sqlite in the working directory)."""
    experiment: str = "graftblock-serve"
    """MLflow experiment of the serving runs."""
    metrics_interval_s: float = 10.0
    """Seconds between the periodic MLflow metric logs. Range (0, 86400]."""
    learner: LearnerServeConfig = field(default_factory=LearnerServeConfig)
    """Online adaptation of the drafter while serving (:class:`LearnerServeConfig`; a mapping in YAML)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError(f"serve.model must be a model alias, HF id or directory, got {self.model!r}")
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        if not isinstance(self.method, str) or not self.method:
            raise ConfigError(f"serve.method must be a method name, got {self.method!r}")
        if not isinstance(self.methods, Mapping) or not all(isinstance(v, Mapping) for v in self.methods.values()):
            raise ConfigError("serve.methods must map method name -> mapping of drafter options")
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            if self.host != "localhost":
                raise ConfigError(f"serve.host must be an IP address or localhost, got {self.host!r}") from None
        _int("port", self.port, 1, 65535)
        try:
            object.__setattr__(self, "proxy_location", ProxyLocation(self.proxy_location))
        except ValueError:
            raise ConfigError(f"serve.proxy_location must be one of {[p.value for p in ProxyLocation]}, "
                              f"got {self.proxy_location!r}") from None
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ConfigError("serve.api_key must be a non-empty string or null")
        if self.api_key is None and not _is_loopback(self.host):
            raise ConfigError(f"serve.host {self.host!r} is reachable from other machines, so serve.api_key is "
                              "required: set one, or bind 127.0.0.1")
        _int("max_prompt_tokens", self.max_prompt_tokens, 1, 1 << 20)
        _int("max_tokens", self.max_tokens, 1, 65536)
        _int("default_max_tokens", self.default_max_tokens, 1, self.max_tokens)
        _int("max_sequences", self.max_sequences, 1, 1024)
        if not isinstance(self.batch, Mapping):
            raise ConfigError(f"serve.batch must be a mapping of BatchConfig options, got {self.batch!r}")
        for own in ("max_sequences", "max_waiting"):
            if own in self.batch:
                raise ConfigError(f"serve.batch.{own}: set serve.{own} instead")
        _int("max_waiting", self.max_waiting, 0, 100000)
        _int("retry_after_s", self.retry_after_s, 1, 3600)
        _seconds("request_timeout_s", self.request_timeout_s)
        _seconds("stall_timeout_s", self.stall_timeout_s)
        _seconds("drain_timeout_s", self.drain_timeout_s, 3600.0)
        _seconds("metrics_interval_s", self.metrics_interval_s)
        if self.torch_threads is not None:
            _int("torch_threads", self.torch_threads, 1, 256)
        _int("num_replicas", self.num_replicas, 1, 1024)
        _int("max_ongoing_requests", self.max_ongoing_requests, 1, 100000)
        _int("replica_retries", self.replica_retries, 0, 10)
        if self.max_ongoing_requests < self.max_sequences + self.max_waiting:
            raise ConfigError(f"serve.max_ongoing_requests ({self.max_ongoing_requests}) must be at least "
                              f"serve.max_sequences + serve.max_waiting ({self.max_sequences + self.max_waiting}): "
                              "Ray Serve must route every request a replica could admit, so that the rest get "
                              "a 429 from the replica instead of waiting unbounded in the proxy")
        try:
            object.__setattr__(self, "drafter_placement", DrafterPlacement(self.drafter_placement))
        except ValueError:
            raise ConfigError(f"serve.drafter_placement must be one of {[p.value for p in DrafterPlacement]}, "
                              f"got {self.drafter_placement!r}") from None
        cpus = self.drafter_worker_cpus
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0 <= cpus <= 64:
            raise ConfigError(f"serve.drafter_worker_cpus must be a number in [0, 64], got {cpus!r}")
        _int("drafter_worker_max_restarts", self.drafter_worker_max_restarts, 0, 1000)
        _seconds("drafter_call_timeout_s", self.drafter_call_timeout_s, 3600.0)
        _seconds("drafter_restart_timeout_s", self.drafter_restart_timeout_s, 3600.0)
        if self.drafter_placement is DrafterPlacement.WORKER and self.drafter_call_timeout_s >= self.stall_timeout_s:
            raise ConfigError(f"serve.drafter_call_timeout_s ({self.drafter_call_timeout_s:g}) must be below "
                              f"serve.stall_timeout_s ({self.stall_timeout_s:g}): a slow drafter call must become "
                              "a step without speculation before the engine counts as stalled")
        _int("target_shards", self.target_shards, 0, 256)
        sc = self.shard_cpus
        if isinstance(sc, bool) or not isinstance(sc, (int, float)) or not 0 < sc <= 64 \
                or (sc > 1 and sc != int(sc)):
            raise ConfigError(f"serve.shard_cpus must be a number in (0, 64] (whole above 1), got {sc!r}")
        _int("shard_max_restarts", self.shard_max_restarts, 0, 1000)
        _seconds("shard_restart_timeout_s", self.shard_restart_timeout_s, 3600.0)
        if self.target_shards and self.shard_restart_timeout_s >= self.stall_timeout_s:
            raise ConfigError(f"serve.shard_restart_timeout_s ({self.shard_restart_timeout_s:g}) must be "
                              f"below serve.stall_timeout_s ({self.stall_timeout_s:g}): a step waiting for a "
                              "restarted shard must not count as a stalled engine")
        if not isinstance(self.replica_resources, Mapping) or not self.replica_resources:
            raise ConfigError("serve.replica_resources must be a non-empty mapping of Ray resource -> amount")
        for name, amount in self.replica_resources.items():
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 <= amount < math.inf:
                raise ConfigError(f"serve.replica_resources.{name} must be a finite number >= 0, got {amount!r}")
        if self.ray_num_cpus is not None:
            _int("ray_num_cpus", self.ray_num_cpus, 1, 4096)
            if self.ray_address is not None:
                raise ConfigError("serve.ray_num_cpus applies to a local Ray instance only (ray_address is set)")
        if not isinstance(self.experiment, str) or not self.experiment:
            raise ConfigError("serve.experiment must be a non-empty experiment name")
        object.__setattr__(self, "learner", learner_config_from_dict(self.learner))

    @property
    def model_name(self) -> str:
        """The name clients address the model by."""
        return self.served_model_name or self.model

    def ray_actor_options(self) -> dict[str, Any]:
        """``ray_actor_options`` of a replica: CPUs, GPUs and custom resources."""
        res = dict(self.replica_resources)
        opts: dict[str, Any] = {"num_cpus": res.pop("CPU", 0.0)}
        if "GPU" in res:
            opts["num_gpus"] = res.pop("GPU")
        if res:
            opts["resources"] = res
        return opts

    def replica_dict(self) -> dict[str, Any]:
        """Plain dict (YAML/JSON-friendly) a replica rebuilds the config from (api key included)."""
        return to_dict(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (YAML/JSON-friendly), the api key masked: the MLflow params of a serving run."""
        out = to_dict(self)
        if out["api_key"] is not None:
            out["api_key"] = "***"
        return out

    def with_overrides(self, **changes: Any) -> ServeConfig:
        """A copy with the non-None ``changes`` applied (CLI flags such as ``--host``, ``--port``)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def serve_config_from_dict(data: Mapping[str, Any] | None, where: str = "serve") -> ServeConfig:
    """:class:`ServeConfig` from a mapping, rejecting unknown keys by name."""
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(data) - names, key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    return ServeConfig(**data)


def apply_sets(data: Mapping[str, Any], sets: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``data`` with each ``KEY=VALUE`` of ``sets`` applied (``--set``): VALUE is parsed as YAML,
    KEY may be dotted (``learner.policy``) to set one key of a nested section. The result is
    validated by :func:`serve_config_from_dict` like the file itself."""
    out = copy.deepcopy(dict(data))
    for item in sets:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(f"--set expects KEY=VALUE (KEY may be dotted: learner.policy=static), got {item!r}")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key}: the value {raw!r} is not valid YAML ({exc})") from None
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is {child!r}, not a section")
            node = child
        node[parts[-1]] = value
    return out


def load_serve_config(path: str | Path | None, sets: list[str] | tuple[str, ...] = ()) -> ServeConfig:
    """The config in YAML file ``path`` (None = the embedded default, ``ray_configs/serve_local.yaml``),
    with the ``--set KEY=VALUE`` overrides ``sets`` applied (:func:`apply_sets`)."""
    p = Path(path) if path is not None else LOCAL_SERVE_CONFIG
    data = load_yaml_mapping(p, "--config", "serve option -> value")
    where = str(p) + (" with --set" if sets else "")
    return serve_config_from_dict(apply_sets(data, sets), where=where)
