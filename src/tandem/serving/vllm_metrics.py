"""vLLM's Prometheus metrics, so that vLLM's Grafana dashboard, aiperf's and inference-perf's
server-side reports read `tandem serve` as they read vLLM.

Names, types, buckets and labels are those of vLLM's `vllm/v1/metrics/loggers.py` in the
release that renamed `vllm:time_per_output_token_seconds` to `vllm:inter_token_latency_seconds`
(0.11; the old name is still emitted, with the same observations, as vLLM does under
`--show-hidden-metrics-for-version`). Every series has vLLM's labels `model_name` (the served
model name) and `engine` (the data-parallel rank that ran the request, as vLLM labels its DP
engine cores); sum over `engine` for the server.

Request state, from the ranks' counters (sent 4 times a second):
  vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (gauges;
  vllm:gpu_cache_usage_perc too, its name before 0.10, which vLLM's example dashboard reads)
  vllm:num_preemptions_total: counted by the scheduler where it preempts
Per engine request (a choice: `n` choices are `n` requests, as in vLLM):
  vllm:prompt_tokens_total, vllm:generation_tokens_total
  vllm:request_success_total{finished_reason}    stop | length | abort | error
  vllm:time_to_first_token_seconds               arrival at the front end -> first token there
  vllm:e2e_request_latency_seconds               arrival at the front end -> final output there
  vllm:inter_token_latency_seconds               gap between consecutive sampled tokens
  vllm:request_queue_time_seconds                queued -> first scheduled
  vllm:request_prefill_time_seconds              first scheduled -> first token
  vllm:request_decode_time_seconds               first token -> last token
  vllm:request_inference_time_seconds            first scheduled -> last token
  vllm:request_time_per_output_token_seconds     decode time / (tokens - 1)
  vllm:request_prompt_tokens, vllm:request_generation_tokens, vllm:request_params_max_tokens
  vllm:request_params_n, vllm:request_max_num_generation_tokens
                                                 once per prompt when all its choices finished:
                                                 its `n`, the most tokens a choice generated

Where each time is taken: arrival and the final output where the client sees them, on the
front end's clock (as vLLM's front end does). Queued, scheduled and each token on the clock
of the rank that ran the request, by its scheduler, when it happens: a token when its step's
result reaches the host. Intervals between rank events are differences of one rank's clock,
so ranks on other hosts need no clock agreement. Preemptions do not reset "first scheduled",
so a preempted request's recompute time is in its prefill or decode time, as in vLLM.

A request that ends before it has the events an interval needs (refused by the engine, or
failed before its first token) is counted in `request_success_total` and `e2e`, not in that
interval's histogram. A request the client leaves is counted as `abort` only.
"""

from __future__ import annotations

import time
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.engine.outputs import RequestOutput
from tandem.serving.engine_client import EngineClient

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets, to max_model_len)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class VllmMetrics:
    """vLLM's metrics in `registry`, for the requests of one app."""

    def __init__(self, registry: CollectorRegistry, client: EngineClient, model_name: str) -> None:
        self.model_name = model_name
        engines = [str(i) for i in range(client.num_engines)]
        token_buckets = one_two_five_buckets(client.max_model_len)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            metric = Histogram(name, doc, LABELS, buckets=buckets, registry=registry)
            for engine in engines:  # every series exists from the start, as in vLLM
                metric.labels(model_name, engine)
            return metric

        def counter(name: str, doc: str) -> Counter:
            metric = Counter(name, doc, LABELS, registry=registry)
            for engine in engines:
                metric.labels(model_name, engine)
            return metric

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       [*LABELS, "finished_reason"], registry=registry)
        for engine in engines:
            for reason in FINISH_REASONS:
                self.request_success.labels(model_name, engine, reason)
        self.prompt_tokens_per_request = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.generation_tokens_per_request = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self.n_param = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.max_tokens_param = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets)
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            token_buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            TOKEN_LATENCY_BUCKETS)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        registry.register(EngineStateCollector(client, model_name, len(engines)))

    def track_prompt(self, arrival: float, max_tokens: int, n: int) -> list["RequestTracker"]:
        """Trackers for the `n` engine requests (choices) of one prompt that arrived at
        `arrival` (`time.perf_counter()`)."""
        prompt = PromptTracker(self, n)
        return [RequestTracker(self, arrival, max_tokens, prompt) for _ in range(n)]


class PromptTracker:
    """The choices of one prompt (vLLM's parent request): once all have finished, its `n`
    and the most tokens a choice generated are observed, as vLLM does."""

    def __init__(self, metrics: VllmMetrics, n: int) -> None:
        self.metrics = metrics
        self.n = n
        self.unfinished = n
        self.most_tokens = 0

    def choice_finished(self, labels: tuple[str, str], num_tokens: int) -> None:
        self.unfinished -= 1
        self.most_tokens = max(self.most_tokens, num_tokens)
        if self.unfinished == 0:
            self.metrics.n_param.labels(*labels).observe(self.n)
            self.metrics.max_num_generation_tokens.labels(*labels).observe(self.most_tokens)


class RequestTracker:
    """Turns one engine request's outputs, as they reach the front end, into observations."""

    def __init__(self, metrics: VllmMetrics, arrival: float, max_tokens: int, prompt: PromptTracker) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.max_tokens = max_tokens
        self.prompt = prompt
        self.seen_output = False
        self.finished = False
        #: The engine that runs it, known from its first output.
        self.engine = "0"
        self.num_tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        self.engine = str(out.engine_index)
        m, labels = self.metrics, (self.metrics.model_name, self.engine)
        if not self.seen_output:
            self.seen_output = True
            m.prompt_tokens.labels(*labels).inc(out.num_prompt_tokens)
        if out.new_token_ids:
            m.generation_tokens.labels(*labels).inc(len(out.new_token_ids))
        for at in out.token_times:
            if self.first_token_at is None:
                self.first_token_at = at
                m.ttft.labels(*labels).observe(now - self.arrival)
            else:
                gap = at - self.last_token_at
                m.inter_token_latency.labels(*labels).observe(gap)
                m.time_per_output_token.labels(*labels).observe(gap)
            self.last_token_at = at
            self.num_tokens += 1
        if out.finished:
            self._finish(out, labels, now)

    def _finish(self, out: RequestOutput, labels: tuple[str, str], now: float) -> None:
        m = self.metrics
        self.finished = True
        m.request_success.labels(*labels, out.finish_reason or "error").inc()
        m.e2e.labels(*labels).observe(now - self.arrival)
        m.prompt_tokens_per_request.labels(*labels).observe(out.num_prompt_tokens)
        m.generation_tokens_per_request.labels(*labels).observe(out.num_output_tokens)
        m.max_tokens_param.labels(*labels).observe(self.max_tokens)
        self.prompt.choice_finished(labels, out.num_output_tokens)
        if out.queued_at is None or out.scheduled_at is None:
            return
        m.queue_time.labels(*labels).observe(out.scheduled_at - out.queued_at)
        if self.first_token_at is None:
            return
        decode = self.last_token_at - self.first_token_at
        m.prefill_time.labels(*labels).observe(self.first_token_at - out.scheduled_at)
        m.decode_time.labels(*labels).observe(decode)
        m.inference_time.labels(*labels).observe(self.last_token_at - out.scheduled_at)
        # The first token is the prefill's; vLLM reports 0 for a request with one token.
        m.request_time_per_output_token.labels(*labels).observe(decode / (self.num_tokens - 1) if self.num_tokens > 1
                                                                 else 0.0)

    def abandoned(self) -> None:
        """The client left before the final output: the request was aborted."""
        if not self.finished:
            self.finished = True
            self.metrics.request_success.labels(self.metrics.model_name, self.engine, "abort").inc()


class EngineStateCollector(Collector):
    """Each engine's scheduler state and preemption count, read at scrape time."""

    def __init__(self, client: EngineClient, model_name: str, num_engines: int) -> None:
        self.client = client
        self.model_name = model_name
        self.num_engines = num_engines

    def collect(self) -> Iterable[Metric]:
        try:
            per_rank = self.client.stats().per_rank
        except Exception:  # a broken engine must not break the scrape; tandem_engine_healthy says why
            return
        families = [
            (GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.",
             "running"),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting"),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
            (GaugeMetricFamily, "vllm:gpu_cache_usage_perc",
             "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
             "kv_usage"),
            (CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             "preemptions"),
        ]
        for kind, name, doc, key in families:
            family = kind(name, doc, labels=LABELS)
            for engine in range(self.num_engines):
                value = getattr(per_rank[engine], key) if engine < len(per_rank) else 0
                family.add_metric([self.model_name, str(engine)], float(value))
            yield family
