"""`/metrics` speaks vLLM's metric names, types, buckets and labels (what vLLM's Grafana
dashboard, aiperf and inference-perf read), with values that agree with what a real
`tandem serve` did: request and token counts equal to the requests sent and their usage,
the engine's phase intervals adding up (queue + prefill + decode within e2e), finish reasons
counted, and preemptions counted where the scheduler preempts."""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.testing.server_process import Server

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow

SERVED = "tiny-served"
MODEL_LABELS = {"model_name": SERVED, "engine": "0"}

# vLLM's buckets (vllm/v1/metrics/loggers.py, the release that renamed
# time_per_output_token_seconds to inter_token_latency_seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
N_BUCKETS = [1, 2, 5, 10, 20]
#: Every metric the panels of vLLM's example Grafana dashboard
#: (examples/online_serving/prometheus_grafana/grafana.json) query, all by `model_name`.
DASHBOARD = ["vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
             "vllm:time_per_output_token_seconds", "vllm:num_requests_running", "vllm:num_requests_waiting",
             "vllm:time_to_first_token_seconds", "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens",
             "vllm:request_generation_tokens", "vllm:request_success", "vllm:request_queue_time_seconds",
             "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
             "vllm:request_max_num_generation_tokens"]

TIME_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
    "vllm:inter_token_latency_seconds": TOKEN_LATENCY_BUCKETS,
    "vllm:time_per_output_token_seconds": TOKEN_LATENCY_BUCKETS,
    "vllm:request_time_per_output_token_seconds": TOKEN_LATENCY_BUCKETS,
    "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_inference_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_decode_time_seconds": REQUEST_LATENCY_BUCKETS,
}
TOKEN_HISTOGRAMS = ["vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_max_tokens",
                    "vllm:request_max_num_generation_tokens"]
COUNTERS = ["vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions"]
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc"]


def one_two_five(limit: int) -> list[float]:
    return sorted(float(m * 10**e) for e in range(12) for m in (1, 2, 5) if m * 10**e <= limit)


class Scrape:
    """One parse of `/metrics` by Prometheus' own text parser."""

    def __init__(self, text: str):
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def family(self, name: str):
        assert name in self.families, f"{name} missing from /metrics"
        return self.families[name]

    def value(self, sample_name: str, **labels: str) -> float:
        """The sum over the series of `sample_name` whose labels include `labels`."""
        family = self.family(sample_name.removesuffix("_total").removesuffix("_count").removesuffix("_sum"))
        hits = [s.value for s in family.samples
                if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]
        assert hits, f"no {sample_name} series with {labels}"
        return sum(hits)

    def buckets(self, name: str) -> list[float]:
        bounds = [float(s.labels["le"]) for s in self.family(name).samples if s.name == f"{name}_bucket"]
        assert bounds[-1] == math.inf
        return bounds[:-1]


def scrape(server: Server) -> Scrape:
    return Scrape(httpx.get(f"{server.base}/metrics", timeout=10).text)


def settled(server: Server) -> Scrape:
    """A scrape after the ranks reported an idle engine (their gauges are sent 4 times a second)."""
    deadline = time.monotonic() + 30
    while True:
        result = scrape(server)
        if result.value("vllm:num_requests_running") == 0 and result.value("vllm:num_requests_waiting") == 0:
            return result
        assert time.monotonic() < deadline, "the engine did not report idle within 30 s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server():
    with Server("tiny-moe", "--kv-cache-tokens", "4096", "--block-size", "8", "--served-model-name", SERVED) as s:
        yield s


def test_vllm_names_types_buckets_and_labels(server):
    before = scrape(server)
    max_model_len = httpx.get(f"{server.url}/models", timeout=10).json()["data"][0]["max_model_len"]
    for name, buckets in TIME_HISTOGRAMS.items():
        assert before.family(name).type == "histogram", name
        assert before.buckets(name) == buckets, name
    for name in TOKEN_HISTOGRAMS:
        assert before.family(name).type == "histogram", name
        assert before.buckets(name) == one_two_five(max_model_len), name
    assert before.family("vllm:request_params_n").type == "histogram"
    assert before.buckets("vllm:request_params_n") == N_BUCKETS
    for name in COUNTERS:
        assert before.family(name).type == "counter", name
        assert before.value(f"{name}_total", **MODEL_LABELS) == 0, name
    for name in GAUGES:
        assert before.family(name).type == "gauge", name
    for name in [*TIME_HISTOGRAMS, *TOKEN_HISTOGRAMS, *COUNTERS, *GAUGES, "vllm:request_params_n"]:
        for sample in before.family(name).samples:
            assert {k: sample.labels[k] for k in MODEL_LABELS} == MODEL_LABELS, (name, sample)
    for name in DASHBOARD:
        assert any(s.labels.get("model_name") == SERVED for s in before.family(name).samples), name
    reasons = {s.labels["finished_reason"] for s in before.family("vllm:request_success").samples}
    assert reasons == {"stop", "length", "abort", "error"}
    # tandem's own metrics stay beside vLLM's.
    for name in ["tandem_engine_steps", "tandem_engine_overlap_efficiency", "tandem_http_requests"]:
        before.family(name)


def test_values_agree_with_the_requests_served(server):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    before = settled(server)
    ignore_eos = {"ignore_eos": True}  # every sampled token is then a delivered one
    by_length = client.completions.create(model=SERVED, prompt="Hello there", max_tokens=10, temperature=0,
                                          extra_body=ignore_eos)
    text = by_length.choices[0].text
    stop = text[3:5]
    by_stop = client.completions.create(model=SERVED, prompt="Hello there", max_tokens=10, temperature=0,
                                        stop=[stop], extra_body=ignore_eos)
    assert (by_length.choices[0].finish_reason, by_stop.choices[0].finish_reason) == ("length", "stop")
    streamed_usage = None
    for chunk in client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6, stream=True, stream_options={"include_usage": True},
                                                extra_body=ignore_eos):
        streamed_usage = chunk.usage or streamed_usage
    two = client.completions.create(model=SERVED, prompt="Two choices", max_tokens=4, n=2, extra_body=ignore_eos)
    after = settled(server)

    def delta(sample: str, **labels: str) -> float:
        return after.value(sample, **MODEL_LABELS, **labels) - before.value(sample, **MODEL_LABELS, **labels)

    # One engine request per choice: 1 + 1 + 1 + 2, one `n` per prompt.
    engine_requests = 5
    prompt_tokens = (by_length.usage.prompt_tokens + by_stop.usage.prompt_tokens + streamed_usage.prompt_tokens
                     + 2 * two.usage.prompt_tokens)
    generated = (by_length.usage.completion_tokens + by_stop.usage.completion_tokens
                 + streamed_usage.completion_tokens + two.usage.completion_tokens)
    assert by_stop.usage.completion_tokens < 10 and generated == 10 + by_stop.usage.completion_tokens + 6 + 8

    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    assert delta("vllm:request_success_total", finished_reason="length") == 4
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    assert delta("vllm:request_success_total", finished_reason="error") == 0
    for name in [*TIME_HISTOGRAMS, *TOKEN_HISTOGRAMS]:
        if name not in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
                        "vllm:request_max_num_generation_tokens"):
            assert delta(f"{name}_count") == engine_requests, name
    # Once per prompt, when all its choices finished: its n, and its longest choice.
    assert delta("vllm:request_params_n_count") == 4 and delta("vllm:request_params_n_sum") == 1 + 1 + 1 + 2
    assert delta("vllm:request_max_num_generation_tokens_count") == 4
    assert delta("vllm:request_max_num_generation_tokens_sum") == 10 + by_stop.usage.completion_tokens + 6 + 4
    assert delta("vllm:request_params_max_tokens_sum") == 10 + 10 + 6 + 2 * 4

    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens == delta("vllm:prompt_tokens_total")
    assert delta("vllm:request_generation_tokens_sum") == generated == delta("vllm:generation_tokens_total")
    # One inter-token latency per token after each request's first.
    assert delta("vllm:inter_token_latency_seconds_count") == generated - engine_requests
    assert delta("vllm:time_per_output_token_seconds_count") == generated - engine_requests
    assert delta("vllm:num_preemptions_total") == 0

    # Orderings of the intervals (not timings): the engine's phases partition its part of the
    # request, and that part lies inside what the front end saw.
    queue, prefill = delta("vllm:request_queue_time_seconds_sum"), delta("vllm:request_prefill_time_seconds_sum")
    decode, inference = delta("vllm:request_decode_time_seconds_sum"), delta("vllm:request_inference_time_seconds_sum")
    e2e, ttft = delta("vllm:e2e_request_latency_seconds_sum"), delta("vllm:time_to_first_token_seconds_sum")
    itl = delta("vllm:inter_token_latency_seconds_sum")
    assert min(queue, prefill, decode, inference, e2e, ttft) >= 0 and prefill > 0 and decode > 0
    assert prefill + decode == pytest.approx(inference, rel=1e-6)
    assert itl == pytest.approx(decode, rel=1e-6)  # a request's gaps add up to its decode time
    assert queue + prefill <= ttft <= e2e
    assert queue + inference <= e2e
    assert after.value("vllm:kv_cache_usage_perc", **MODEL_LABELS) == 0
    assert after.value("vllm:gpu_cache_usage_perc", **MODEL_LABELS) == 0


def test_a_client_that_leaves_is_an_abort(server):
    before = settled(server)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/completions",
                         json={"model": SERVED, "prompt": "leave", "max_tokens": 1000, "stream": True,
                               "ignore_eos": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            while not next(lines).startswith("data: {"):
                pass  # left after the first token
    deadline = time.monotonic() + 30
    while True:
        after = settled(server)
        aborted = (after.value("vllm:request_success_total", finished_reason="abort", **MODEL_LABELS)
                   - before.value("vllm:request_success_total", finished_reason="abort", **MODEL_LABELS))
        if aborted:
            break
        assert time.monotonic() < deadline, "the abort was not counted within 30 s"
        time.sleep(0.1)
    assert aborted == 1
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:request_decode_time_seconds_count"):
        assert after.value(name, **MODEL_LABELS) == before.value(name, **MODEL_LABELS), name


def test_preemptions_are_counted_where_the_scheduler_preempts():
    # 8 blocks of 8 tokens, 4 requests growing to 45 tokens each: the scheduler must preempt.
    with Server("tiny-moe", "--kv-cache-tokens", "64", "--block-size", "8", "--max-num-seqs", "4") as small:
        client = openai.AsyncOpenAI(base_url=small.url, api_key="unused", max_retries=0, timeout=120)

        async def one(i: int):
            return await client.completions.create(model="tiny-moe", prompt=f"go {i}", max_tokens=40, seed=i,
                                                   temperature=1.0, extra_body={"ignore_eos": True})

        async def main():
            try:
                return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), timeout=240)
            finally:
                await client.close()

        done = asyncio.run(main())
        assert [d.choices[0].finish_reason for d in done] == ["length"] * 4
        after = settled(small)
        labels = {"model_name": "tiny-moe", "engine": "0"}
        assert after.value("vllm:num_preemptions_total", **labels) > 0
        assert after.value("vllm:request_success_total", finished_reason="length", **labels) == 4
        # A preempted request's prefill (first scheduled to first token) and decode include
        # its time out of the cache, as vLLM's do: the phases still add up.
        prefill = after.value("vllm:request_prefill_time_seconds_sum", **labels)
        decode = after.value("vllm:request_decode_time_seconds_sum", **labels)
        assert prefill + decode == pytest.approx(after.value("vllm:request_inference_time_seconds_sum", **labels),
                                                 rel=1e-6)
        assert after.value("vllm:request_generation_tokens_sum", **labels) == 160


def test_each_data_parallel_rank_is_one_engine():
    with Server("tiny-moe", "--data-parallel-size", "2", "--kv-cache-tokens", "4096") as dp2:
        client = openai.AsyncOpenAI(base_url=dp2.url, api_key="unused", max_retries=0, timeout=120)

        async def main():
            try:
                return await asyncio.wait_for(asyncio.gather(*(
                    client.completions.create(model="tiny-moe", prompt=f"rank {i}", max_tokens=24,
                                              extra_body={"ignore_eos": True}) for i in range(4)
                )), timeout=240)
            finally:
                await client.close()

        done = asyncio.run(main())
        after = settled(dp2)
        per_engine = {engine: after.value("vllm:e2e_request_latency_seconds_count", model_name="tiny-moe", engine=engine)
                      for engine in ("0", "1")}
        # Requests go to the rank with the fewest in flight, so concurrent ones spread; each is
        # counted once, under the rank that ran it.
        assert sum(per_engine.values()) == 4 and min(per_engine.values()) >= 1
        assert after.value("vllm:generation_tokens_total") == sum(d.usage.completion_tokens for d in done) == 96
        for name in GAUGES:
            assert {s.labels["engine"] for s in after.family(name).samples} == {"0", "1"}, name
