"""Prometheus metrics of one HTTP app, in its own `CollectorRegistry` (never the global one,
so two apps in one process do not collide): vLLM's (`tandem.serving.vllm_metrics`, what vLLM
dashboards read) and tandem's own, below.

HTTP layer:
  tandem_http_requests_total{endpoint,status}       requests answered
  tandem_http_request_duration_seconds{endpoint}    request latency (streams: until the end)
  tandem_time_to_first_token_seconds{endpoint}      arrival to first generated token
  tandem_prompt_tokens_total                        prompt tokens sent to the engine (per choice)
  tandem_generation_tokens_total                    tokens generated
  tandem_generation_tokens_per_second               generation rate over the last `window_s`

Engine (read from `EngineClient.stats()` / `health()` at scrape time):
  tandem_engine_ranks, tandem_engine_healthy, tandem_engine_requests_waiting,
  tandem_engine_requests_running, tandem_engine_kv_usage_ratio (gauges);
  tandem_engine_steps_total, tandem_engine_ubatched_steps_total,
  tandem_engine_ubatch_yields_total, tandem_engine_step_time_seconds_total,
  tandem_engine_forward_busy_seconds_total,
  tandem_engine_generated_tokens_total, tandem_engine_prompt_tokens_total (counters);
  time model: tandem_engine_compute_seconds_total, tandem_engine_recv_wait_seconds_total,
  tandem_engine_comm_seconds_total, tandem_engine_ubatch_switch_seconds_total (counters),
  tandem_engine_overlap_efficiency (gauge: hidden / total communication so far);
  pipeline parallelism: tandem_engine_pipeline_stage_idle_ratio{stage} (gauge: the stage's
  idle (bubble) share of its time while the pipeline had work, mean over the DP ranks).

Overlap planner (`--overlap-policy auto`, or `--ubatch-split balanced-cost`), summed over ranks:
  tandem_planner_steps_total{choice}                 steps run with each overlap choice
  tandem_planner_explored_steps_total                of which exploration (another than the best)
  tandem_planner_predicted_steps_total               steps that had a prediction, and over them:
  tandem_planner_predicted_step_seconds_total        predicted step time
  tandem_planner_measured_step_seconds_total         measured step time
  tandem_planner_abs_error_seconds_total             |predicted - measured|
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.serving.engine_client import EngineClient
from tandem.ubatch.planner import PlannerStats
from tandem.serving.vllm_metrics import VllmMetrics

logger = logging.getLogger(__name__)

#: The endpoints labelled by name; anything else is "other" (bounded label cardinality).
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def endpoint_label(path: str) -> str:
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return "other"


class _RateWindow:
    """Tokens per second over the last `window_s` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self._start = time.monotonic()

    def add(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        with self._lock:
            self._events.append((now, n))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            total = sum(n for _, n in self._events)
        span = min(self.window_s, max(now - self._start, 1e-3))
        return total / span


class EngineStatsCollector(Collector):
    """Reads `client.stats()` and `client.health()` once per scrape."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def collect(self) -> Iterable[Metric]:
        try:
            healthy, _ = self.client.health()
        except Exception:  # a broken engine must not break the scrape
            healthy = False
        yield GaugeMetricFamily("tandem_engine_healthy", "1 when every engine rank is alive and stepping", value=float(healthy))
        try:
            stats = self.client.stats()
        except Exception as exc:
            logger.warning("engine stats unavailable for /metrics: %s", type(exc).__name__)
            return
        total = stats.total
        gauges = [
            ("tandem_engine_ranks", "Engine rank processes", stats.num_ranks),
            ("tandem_engine_requests_waiting", "Requests queued, not yet running (all ranks)", total.waiting),
            ("tandem_engine_requests_running", "Requests with a running sequence (all ranks)", total.running),
            ("tandem_engine_kv_usage_ratio", "Fraction of KV blocks in use, max over ranks", total.kv_usage),
            (
                "tandem_engine_overlap_efficiency",
                "Hidden communication / total communication of all steps so far (time model)",
                total.times.overlap_efficiency,
            ),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=float(value))
        if total.pipeline_stage_idle_fraction:
            idle = GaugeMetricFamily(
                "tandem_engine_pipeline_stage_idle_ratio",
                "Pipeline stage idle (bubble) share of its time while the pipeline had work",
                labels=["stage"],
            )
            for stage, value in enumerate(total.pipeline_stage_idle_fraction):
                idle.add_metric([str(stage)], float(value))
            yield idle
        counters = [
            ("tandem_engine_steps", "Model steps run (summed over ranks)", total.steps),
            ("tandem_engine_ubatched_steps", "Model steps split into ubatches", total.ubatched_steps),
            ("tandem_engine_ubatch_yields", "Micro-batch switches made", total.ubatch_yields),
            ("tandem_engine_step_time_seconds", "Wall time inside model steps (summed over ranks)", total.step_time_s),
            (
                "tandem_engine_forward_busy_seconds",
                "Time the forward worker spent running steps, scheduling included (summed over ranks)",
                total.forward_busy_s,
            ),
            ("tandem_engine_generated_tokens", "Tokens generated, as counted by the engine", total.generated_tokens),
            ("tandem_engine_prompt_tokens", "Prompt tokens processed, as counted by the engine", total.prompt_tokens),
            ("tandem_engine_failed_steps", "Model steps that raised (their requests got an error)", total.failed_steps),
            ("tandem_engine_compute_seconds", "Time model: step time less receive waits and ubatch switches", total.times.compute_s),
            ("tandem_engine_recv_wait_seconds", "Time model: blocked on receives (exposed communication)", total.times.recv_wait_s),
            ("tandem_engine_comm_seconds", "Time model: transfer durations, hidden or not", total.times.comm_s),
            ("tandem_engine_ubatch_switch_seconds", "Time model: ubatch hand-over latency", total.times.switch_s),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=float(value))
        if total.planner is not None:
            yield from _planner_metrics(total.planner)


def _planner_metrics(planner: PlannerStats) -> Iterable[Metric]:
    steps = CounterMetricFamily("tandem_planner_steps", "Steps run with each overlap choice (summed over ranks)", labels=["choice"])
    for choice, n in sorted(planner.choices.items()):
        steps.add_metric([choice], float(n))
    yield steps
    for name, doc, value in [
        ("tandem_planner_explored_steps", "Steps the planner ran another choice than its best, to explore", planner.explored_steps),
        ("tandem_planner_predicted_steps", "Steps that had a predicted step time", planner.predicted_steps),
        ("tandem_planner_predicted_step_seconds", "Predicted step time of the choice taken", planner.predicted_s),
        ("tandem_planner_measured_step_seconds", "Measured step time of the steps that had a prediction", planner.measured_s),
        ("tandem_planner_abs_error_seconds", "Absolute error of the predicted step time", planner.abs_error_s),
    ]:
        yield CounterMetricFamily(name, doc, value=float(value))


class ServingMetrics:
    """The metrics of one app. Not shared between apps."""

    def __init__(self, client: EngineClient, *, model_name: str | None = None, window_s: float = 10.0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.vllm = VllmMetrics(r, client, model_name or client.model_name)
        self.requests = Counter(
            "tandem_http_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "tandem_http_request_duration_seconds", "HTTP request latency (streams: until the last byte)",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds", "Time from request arrival to its first generated token",
            ["endpoint"], buckets=_TTFT_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "Prompt tokens sent to the engine (once per choice)", registry=r
        )
        self.generation_tokens = Counter("tandem_generation_tokens", "Tokens generated", registry=r)
        self._window = _RateWindow(window_s)
        self.tokens_per_second = Gauge(
            "tandem_generation_tokens_per_second", f"Generated tokens per second over the last {window_s:g} s",
            registry=r,
        )
        self.tokens_per_second.set_function(self._window.rate)
        r.register(EngineStatsCollector(client))

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.latency.labels(endpoint=endpoint).observe(seconds)

    def observe_ttft(self, endpoint: str, seconds: float) -> None:
        self.ttft.labels(endpoint=endpoint).observe(seconds)

    def add_prompt_tokens(self, n: int) -> None:
        if n > 0:
            self.prompt_tokens.inc(n)

    def add_generated_tokens(self, n: int) -> None:
        if n > 0:
            self.generation_tokens.inc(n)
            self._window.add(n)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
