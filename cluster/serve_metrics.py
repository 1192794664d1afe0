"""What a serving replica reports: Prometheus metrics (``/metrics``) and its MLflow serving run.

* :class:`ServeMetrics`: counters and histograms in the replica's own registry.
* :class:`ServingReporter`: a daemon thread that logs the replica's periodic figures (tokens/s,
  live and waiting requests, tau, the learner's decisions) to its MLflow serving run
  (``tracking.serving``), and ends the run FINISHED or FAILED.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cluster.serve_config import ServeConfig
from tracking.runs import RunStatus
from tracking.serving import ServingRun

if TYPE_CHECKING:  # the service imports this module for its metrics
    from cluster.openai_service import OpenAIService

log = logging.getLogger("graftblock.serve")


class ServeMetrics:
    """Prometheus metrics of one replica (its own registry, served at ``/metrics``)."""

    LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
    ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("graftblock_requests", "Finished requests by endpoint and outcome "
                                "(finish reason or error type)", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("graftblock_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("graftblock_generation_tokens", "Generated tokens", ["method"], registry=r)
        self.ttft = Histogram("graftblock_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=self.LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("graftblock_inter_token_latency_seconds", "Seconds per output token after the "
                             "first (a step's interval spread over the tokens it produced)",
                             buckets=self.LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("graftblock_request_latency_seconds", "Request arrival to its last token",
                             buckets=self.LATENCY_BUCKETS, registry=r)
        self.acceptance = Histogram("graftblock_acceptance_length", "Tokens gained per verify step, bonus "
                                    "included (tau's distribution)", ["method"], buckets=self.ACCEPT_BUCKETS,
                                    registry=r)
        self.accepted = Counter("graftblock_accepted_draft_tokens", "Draft tokens accepted", ["method"], registry=r)
        self.drafted = Counter("graftblock_draft_tokens", "Draft nodes proposed", ["method"], registry=r)
        self.running = Gauge("graftblock_running_requests", "Requests with at least one token, not finished",
                             registry=r)
        self.waiting = Gauge("graftblock_waiting_requests", "Requests submitted, no token yet", registry=r)
        self.drafter_events = Counter("graftblock_drafter_worker_events", "Drafter-worker faults and recovery "
                                      "(drafter_placement: worker): fallback_step, timeout, died, restart, recreate, "
                                      "rebuild (cluster.resilient_drafter.DrafterEvent)", ["event"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)



class ServingReporter:
    """Logs the replica's periodic metrics to its MLflow serving run from a small daemon thread."""

    def __init__(self, service: OpenAIService, config: ServeConfig, replica: str) -> None:
        self.service, self.config = service, config
        self.run = ServingRun.open(config.experiment, config.tracking_uri, config.to_dict(), replica,
                                   run_name=f"serve-{replica}")
        self._stop = threading.Event()
        self._step = 0
        self._last = (time.monotonic(), 0)
        self._thread = threading.Thread(target=self._loop, name="graftblock-mlflow", daemon=True)
        self._thread.start()

    def sample(self) -> dict[str, float]:
        s = self.service
        now, tokens = time.monotonic(), s.tokens_out
        dt = max(now - self._last[0], 1e-9)
        out = {"tokens_per_s": (tokens - self._last[1]) / dt, "live_requests": float(s.engine.live),
               "waiting_requests": float(s.waiting_requests),
               "finished_requests": float(s.finished_requests), "generated_tokens": float(tokens)}
        if s.verify_steps:
            out[f"{s.method}.tau"] = s.tokens_gained / s.verify_steps
        if s.learner is not None:
            out.update(s.learner.sample())
        self._last = (now, tokens)
        return out

    def _log_decisions(self) -> None:
        """Every learner decision as ``learner.<metric>`` (and ``learner.outcome.<name>`` = 1) at
        step = its index among the replica's decisions."""
        if self.service.learner is None:
            return
        for index, d in self.service.learner.take_decisions():
            self.run.log({**{f"learner.{k}": v for k, v in d.metrics().items()},
                          f"learner.outcome.{d.outcome.value}": 1.0}, index)

    def _loop(self) -> None:
        while not self._stop.wait(self.config.metrics_interval_s):
            self._log()

    def _log(self) -> None:
        try:
            self.run.log(self.sample(), self._step)
            self._step += 1
            self._log_decisions()
        except Exception:  # a tracking hiccup must not take serving down; it is logged
            log.exception("could not log serving metrics to MLflow")

    def finish(self, failed: bool) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._log()
        self.run.finish(RunStatus.FAILED if failed else RunStatus.FINISHED)
