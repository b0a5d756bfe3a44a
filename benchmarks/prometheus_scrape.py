"""A real Prometheus scraping `tandem serve`'s vLLM metrics, queried as a vLLM dashboard would.

Starts `tandem serve` (tiny-moe) and a Prometheus server (the `prometheus` binary on PATH:
`apt-get install prometheus` on Debian) whose scrape config points at the server's /metrics,
both on free loopback ports with Prometheus' storage in a temporary directory; sends a mixed
streaming load with the official `openai` client (some requests end on a stop string, the
rest on max_tokens); waits until Prometheus has scraped the final counts; then asks
Prometheus' HTTP API (`/api/v1/query`) for request counts, finish reasons, token totals,
mean phase times and histogram_quantile()s of TTFT, ITL and e2e, next to what the client
measured itself, and runs one query per panel of vLLM's example Grafana dashboard (how many
series each returns). Both processes are stopped and the directory removed however the run ends.

    python benchmarks/prometheus_scrape.py
    python benchmarks/prometheus_scrape.py --requests 64 --concurrency 16 --max-tokens 48

Prints a table and writes benchmarks/results/prometheus_scrape.json. Client-side quantiles
are exact; Prometheus' are interpolated inside vLLM's buckets, so they agree only to the
bucket's width.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
from tandem.distributed.launch import find_free_port  # noqa: E402
from tandem.testing.server_process import Server, wait_ready  # noqa: E402

SCRAPE_INTERVAL_S = 1


class Prometheus:
    """A Prometheus server scraping `target` (host:port) every second, in its own temp dir."""

    def __init__(self, target: str, binary: str = "prometheus"):
        if shutil.which(binary) is None:
            raise SystemExit(f"no '{binary}' on PATH: install Prometheus (Debian: apt-get install -y prometheus)")
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-prometheus-"))
        self.port = find_free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = self.dir / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
            "scrape_configs:\n"
            "  - job_name: tandem\n"
            "    static_configs:\n"
            f"      - targets: ['{target}']\n"
        )
        self.log = open(self.dir / "prometheus.log", "w+")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            wait_ready(f"{self.base}/-/ready", 60, [self.proc], what="prometheus", detail=self.output)
        except BaseException:
            self.close()
            raise

    def wait_scraped(self, timeout_s: float = 30) -> None:
        """Until the first scrape is in (Prometheus starts scraping a few seconds after it is
        ready), so that rate() windows hold samples from before the load."""
        deadline = time.monotonic() + timeout_s
        while self.scalar('up{job="tandem"}') != 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no successful scrape within {timeout_s:g} s: {self.target_health()}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def query(self, promql: str) -> list[dict]:
        body = httpx.get(f"{self.base}/api/v1/query", params={"query": promql}, timeout=10).json()
        if body.get("status") != "success":
            raise RuntimeError(f"query {promql!r} failed: {body}")
        return body["data"]["result"]

    def scalar(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def target_health(self) -> str:
        targets = httpx.get(f"{self.base}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        return ", ".join(f"{t['scrapeUrl']} {t['health']}" for t in targets)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


async def drive(url: str, model: str, requests: int, concurrency: int, max_tokens: int) -> list[dict]:
    """Streams `requests` completions, `concurrency` at a time; every third ends on a stop string."""
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> dict:
        async with gate:
            start = time.perf_counter()
            first = last = None
            reason, usage, times = None, None, []
            stream = await client.completions.create(
                model=model, prompt=f"request {i}: " + "experts " * (1 + i % 9), max_tokens=max_tokens,
                temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
                stop=["e"] if i % 3 == 0 else None, extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage:
                    usage = chunk.usage
                if chunk.choices and chunk.choices[0].text:
                    first = first if first is not None else now
                    times.append(now)
                    last = now
                if chunk.choices and chunk.choices[0].finish_reason:
                    reason = chunk.choices[0].finish_reason
            return {"ttft": (first or last or time.perf_counter()) - start, "e2e": time.perf_counter() - start,
                    "gaps": [b - a for a, b in zip(times, times[1:])], "reason": reason,
                    "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}

    try:
        return await asyncio.gather(*(one(i) for i in range(requests)))
    finally:
        await client.close()


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prometheus", default="prometheus", help="the Prometheus binary")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prometheus_scrape.json")
    args = parser.parse_args()

    model = "tiny-moe"
    with Server(model, "--kv-cache-tokens", "16384") as server:
        prometheus = Prometheus(f"127.0.0.1:{server.port}", args.prometheus)
        try:
            prometheus.wait_scraped()
            started = time.perf_counter()
            results = asyncio.run(drive(server.url, model, args.requests, args.concurrency, args.max_tokens))
            wall = time.perf_counter() - started
            count = f'sum(vllm:e2e_request_latency_seconds_count{{model_name="{model}"}})'
            deadline = time.monotonic() + 30
            while prometheus.scalar(count) != args.requests:
                if time.monotonic() > deadline:
                    raise SystemExit(f"Prometheus never saw {args.requests} requests ({prometheus.target_health()})")
                time.sleep(SCRAPE_INTERVAL_S)
            rows = table(prometheus, results, model)
            panels = {title: len(prometheus.query(promql)) for title, promql in dashboard_panels(model).items()}
            health = prometheus.target_health()
            version = subprocess.run([args.prometheus, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
        finally:
            prometheus.close()

    print(f"{version}; target {health}")
    print(f"{args.requests} streamed requests, concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
          f"tiny-moe, {wall:.1f} s")
    width = max(len(r["query"]) for r in rows)
    print(f"{'PromQL':<{width}}  {'Prometheus':>11}  {'client':>9}")
    for r in rows:
        prom = "-" if r["prometheus"] is None else f"{r['prometheus']:.4g}"
        client = "" if r["client"] is None else f"{r['client']:.4g}"
        print(f"{r['query']:<{width}}  {prom:>11}  {client:>9}")
    print("vLLM's example Grafana dashboard, series per panel: "
          + ", ".join(f"{title} {n}" for title, n in panels.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"prometheus": version, "requests": args.requests, "concurrency": args.concurrency,
                                    "max_tokens": args.max_tokens, "wall_s": wall, "rows": rows,
                                    "dashboard_panel_series": panels}, indent=2) + "\n")
    print(f"wrote {args.out}")


def dashboard_panels(model: str) -> dict[str, str]:
    """One query per panel of vLLM's example Grafana dashboard
    (examples/online_serving/prometheus_grafana/grafana.json), its variables filled in."""
    sel, window = f'{{model_name="{model}"}}', "[1m]"

    def p99(metric: str) -> str:
        return f"histogram_quantile(0.99, sum by (le) (rate(vllm:{metric}_bucket{sel}{window})))"

    return {
        "E2E Request Latency": p99("e2e_request_latency_seconds"),
        "Token Throughput": f"rate(vllm:generation_tokens_total{sel}{window})",
        "Time Per Output Token Latency": p99("time_per_output_token_seconds"),
        "Scheduler State": f"vllm:num_requests_running{sel}",
        "Time To First Token Latency": p99("time_to_first_token_seconds"),
        "Cache Utilization": f"vllm:gpu_cache_usage_perc{sel}",
        "Request Prompt Length": f"sum by (le) (increase(vllm:request_prompt_tokens_bucket{sel}{window}))",
        "Request Generation Length": f"sum by (le) (increase(vllm:request_generation_tokens_bucket{sel}{window}))",
        "Finish Reason": f"sum by (finished_reason) (increase(vllm:request_success_total{sel}{window}))",
        "Queue Time": f"rate(vllm:request_queue_time_seconds_sum{sel}{window})",
        "Requests Prefill and Decode Time": f"rate(vllm:request_prefill_time_seconds_sum{sel}{window})",
        "Max Generation Token in Sequence Group": f"rate(vllm:request_max_num_generation_tokens_sum{sel}{window})",
    }


def table(prometheus: Prometheus, results: list[dict], model: str) -> list[dict]:
    sel = f'{{model_name="{model}"}}'
    gaps = [g for r in results for g in r["gaps"]]
    by_reason = {reason: sum(1 for r in results if r["reason"] == reason) for reason in ("stop", "length")}

    def mean(metric: str) -> str:
        return f"sum(vllm:{metric}_sum{sel}) / sum(vllm:{metric}_count{sel})"

    def q(metric: str, p: float) -> str:
        return f"histogram_quantile({p}, sum by (le) (vllm:{metric}_bucket{sel}))"

    queries = [
        (f"sum(vllm:e2e_request_latency_seconds_count{sel})", len(results)),
        (f'sum(vllm:request_success_total{{model_name="{model}",finished_reason="stop"}})', by_reason["stop"]),
        (f'sum(vllm:request_success_total{{model_name="{model}",finished_reason="length"}})', by_reason["length"]),
        (f"sum(vllm:prompt_tokens_total{sel})", sum(r["prompt_tokens"] for r in results)),
        (f"sum(vllm:generation_tokens_total{sel})", sum(r["completion_tokens"] for r in results)),
        (f"sum(vllm:num_preemptions_total{sel})", None),
        (q("time_to_first_token_seconds", 0.5), quantile([r["ttft"] for r in results], 0.5)),
        (q("time_to_first_token_seconds", 0.99), quantile([r["ttft"] for r in results], 0.99)),
        ("histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket"
         f"{sel}[2m])))", None),
        (q("inter_token_latency_seconds", 0.5), quantile(gaps, 0.5)),
        (q("e2e_request_latency_seconds", 0.5), quantile([r["e2e"] for r in results], 0.5)),
        (mean("time_to_first_token_seconds"), statistics.mean(r["ttft"] for r in results)),
        (mean("inter_token_latency_seconds"), statistics.mean(gaps) if gaps else None),
        (mean("request_queue_time_seconds"), None),
        (mean("request_prefill_time_seconds"), None),
        (mean("request_decode_time_seconds"), None),
        (mean("e2e_request_latency_seconds"), statistics.mean(r["e2e"] for r in results)),
    ]
    return [{"query": promql, "prometheus": prometheus.scalar(promql), "client": client} for promql, client in queries]


if __name__ == "__main__":
    main()
