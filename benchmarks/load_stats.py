"""What ``benchmarks/load_locust.py`` measures and decides, without locust (which monkey-patches the
standard library with gevent on import): per-stage statistics, the run's config, the verdict."""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from typing import Any
from urllib.parse import urlparse

from benchmarks.serve_load import LOOPBACK, percentile

ITL_TARGET_RATIO = 3.0
"""The target: p99 ITL at twice the saturating concurrency within this factor of its one-user value."""


@dataclasses.dataclass
class StageStats:
    users: int
    seconds: float = 0.0
    finished: int = 0
    tokens: int = 0
    ttft: list[float] = dataclasses.field(default_factory=list)
    itl: list[float] = dataclasses.field(default_factory=list)
    errors: Counter = dataclasses.field(default_factory=Counter)

    def to_json(self) -> dict[str, Any]:
        return {
            "users": self.users, "seconds": round(self.seconds, 2), "requests_ok": self.finished,
            "completion_tokens": self.tokens,
            "goodput_tokens_per_s": self.tokens / self.seconds if self.seconds else None,
            "ttft_p50_s": percentile(self.ttft, 50), "ttft_p99_s": percentile(self.ttft, 99),
            "itl_p50_s": percentile(self.itl, 50), "itl_p99_s": percentile(self.itl, 99),
            "itl_mean_s": statistics.fmean(self.itl) if self.itl else None,
            "errors": dict(sorted(self.errors.items())),
        }


class Recorder:
    """Where the users put what they measured: the current stage's stats, and the in-flight count."""

    def __init__(self) -> None:
        self.stages: list[StageStats] = []
        self.in_flight = 0
        self.sent = 0
        self.draining = False

    @property
    def stage(self) -> StageStats:
        return self.stages[-1]


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    base_url: str
    prompts: tuple[str, ...]
    model: str
    stages: tuple[int, ...]
    stage_seconds: float = 30.0
    max_tokens: int = 64
    api_key: str | None = None
    drain_seconds: float = 120.0
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        host = urlparse(self.base_url).hostname
        if host not in LOOPBACK:
            raise ValueError(f"load.base_url must be a loopback address (this is a load generator), got {host!r}")
        if not self.prompts:
            raise ValueError("load.prompts must hold at least one prompt")
        if not self.stages or any(not isinstance(u, int) or u < 1 for u in self.stages):
            raise ValueError(f"load.stages must be user counts >= 1, got {self.stages!r}")
        if not 0 < self.stage_seconds <= 3600:
            raise ValueError(f"load.stage_seconds must be in (0, 3600], got {self.stage_seconds!r}")
        if not 1 <= self.max_tokens <= 65536:
            raise ValueError(f"load.max_tokens must be in [1, 65536], got {self.max_tokens!r}")


def verdict(result: dict[str, Any], saturation: int) -> dict[str, Any]:
    """The targets at 2x saturation: no 5xx, nothing lost, p99 ITL within 3x of one user's."""
    stages = {s["users"]: s for s in result["stages"]}
    one, loaded = stages.get(1), stages.get(2 * saturation)
    if one is None or loaded is None:
        return {"evaluated": False, "why": "the stages need 1 and 2 x saturation users"}
    five = sum(n for code, n in loaded["errors"].items() if code[:1] == "5" or code.startswith("stream_error"))
    ratio = (loaded["itl_p99_s"] / one["itl_p99_s"]) if one["itl_p99_s"] and loaded["itl_p99_s"] else None
    return {"evaluated": True, "users": 2 * saturation, "server_errors": five, "lost": result["lost"],
            "itl_p99_ratio": ratio, "itl_target_ratio": ITL_TARGET_RATIO,
            "met": five == 0 and result["lost"] == 0 and ratio is not None and ratio <= ITL_TARGET_RATIO}


def default_stages(saturation: int) -> tuple[int, ...]:
    return tuple(sorted({1, max(1, saturation // 2), saturation, 2 * saturation, 3 * saturation, 4 * saturation}))


