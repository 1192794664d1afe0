"""The serving configuration: one validated dataclass, loadable from YAML.

``ray_configs/serve_local.yaml`` is the embedded default (a local Ray instance on this machine);
``ray_configs/serve_cluster.yaml`` is the multi-node variant (replicas, an MLflow server). Every
field is documented below; errors name the field and the allowed range (:class:`ConfigError`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from speculation.config import ConfigError, DType, load_yaml_mapping, to_dict

#: The file that holds the embedded default serving config.
LOCAL_SERVE_CONFIG = Path(__file__).resolve().parent.parent / "ray_configs" / "serve_local.yaml"


def _int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"serve.{name} must be an integer in [{lo}, {hi}], got {value!r}")


def _seconds(name: str, value: Any, hi: float = 86400.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(float(value)) \
            or not 0 < value <= hi:
        raise ConfigError(f"serve.{name} must be a number of seconds in (0, {hi}], got {value!r}")


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
    """torch intra-op threads in each replica (None = torch's default). Range [1, 256]."""
    num_replicas: int = 1
    """Ray Serve replicas, each with its own engine. Range [1, 1024]."""
    replica_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    """Ray resources per replica, e.g. ``{CPU: 1}`` here or ``{GPU: 1, CPU: 4}`` on a GPU node."""
    max_ongoing_requests: int = 64
    """Requests Ray Serve routes to one replica at a time (the rest queue in the proxy). Range [1, 100000]."""
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
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ConfigError("serve.api_key must be a non-empty string or null")
        _int("max_prompt_tokens", self.max_prompt_tokens, 1, 1 << 20)
        _int("max_tokens", self.max_tokens, 1, 65536)
        _int("default_max_tokens", self.default_max_tokens, 1, self.max_tokens)
        _int("max_sequences", self.max_sequences, 1, 1024)
        if not isinstance(self.batch, Mapping):
            raise ConfigError(f"serve.batch must be a mapping of BatchConfig options, got {self.batch!r}")
        if "max_sequences" in self.batch:
            raise ConfigError("serve.batch.max_sequences: set serve.max_sequences instead")
        _seconds("request_timeout_s", self.request_timeout_s)
        _seconds("stall_timeout_s", self.stall_timeout_s)
        _seconds("drain_timeout_s", self.drain_timeout_s, 3600.0)
        _seconds("metrics_interval_s", self.metrics_interval_s)
        if self.torch_threads is not None:
            _int("torch_threads", self.torch_threads, 1, 256)
        _int("num_replicas", self.num_replicas, 1, 1024)
        _int("max_ongoing_requests", self.max_ongoing_requests, 1, 100000)
        if not isinstance(self.replica_resources, Mapping) or not self.replica_resources:
            raise ConfigError("serve.replica_resources must be a non-empty mapping of Ray resource -> amount")
        for name, amount in self.replica_resources.items():
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount >= 0:
                raise ConfigError(f"serve.replica_resources.{name} must be a number >= 0, got {amount!r}")
        if self.ray_num_cpus is not None:
            _int("ray_num_cpus", self.ray_num_cpus, 1, 4096)
            if self.ray_address is not None:
                raise ConfigError("serve.ray_num_cpus applies to a local Ray instance only (ray_address is set)")
        if not isinstance(self.experiment, str) or not self.experiment:
            raise ConfigError("serve.experiment must be a non-empty experiment name")

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
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    return ServeConfig(**data)


def load_serve_config(path: str | Path | None) -> ServeConfig:
    """The config in YAML file ``path`` (None = the embedded default, ``ray_configs/serve_local.yaml``)."""
    p = Path(path) if path is not None else LOCAL_SERVE_CONFIG
    data = load_yaml_mapping(p, "--config", "serve option -> value")
    return serve_config_from_dict(data, where=str(p))
