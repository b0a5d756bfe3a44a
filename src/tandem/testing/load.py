"""A bounded load generator for `tandem serve`: many concurrent streaming clients, each
looping over requests until its round ends, with every request accounted for.

Each client sends streaming completions (`ignore_eos`, `stream_options.include_usage`) of a
random length; a request ends in exactly one of these outcomes:

- completed: the stream ended with `[DONE]` after a finish reason, and the usage reports
  exactly the `max_tokens` asked for;
- rejected: 429 (queue full, `--max-queue-len`; or the per-key stream cap) or 503, with an
  OpenAI-shaped JSON error; the client backs off briefly and goes on;
- disconnected: the client walked away mid-stream on purpose (every `disconnect_every`-th
  request), which the server must turn into an abort that frees the request's KV blocks;
- error: anything else (an error event, a short or cut stream, a timeout, a 5xx, a
  transport error). A correct server gives none.

After each round the driver waits (bounded) for the engine to drain, reads `/metrics`
(requests running and waiting, KV usage: all must return to 0) and the resident memory of
the server's processes, so rounds can be compared for growth.

`run_load(base_url, pids, LoadConfig(...))` drives one server; `benchmarks/load.py` and
`tests/serving/test_load.py` use it.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import httpx

OUTCOMES = ("completed", "rejected_429", "rejected_503", "disconnected", "error")


@dataclass
class LoadConfig:
    clients: int = 256
    round_s: float = 60.0
    rounds: int = 3
    min_tokens: int = 4
    max_tokens: int = 48
    max_prompt_words: int = 24
    #: Distinct prompts, drawn from by every request. Bounded on purpose: the tokenizer
    #: caches the encoding of up to 10,000 distinct prompts (a bounded cache that would
    #: otherwise read as growth across the first rounds).
    prompt_pool: int = 1000
    #: Every n-th request of a client disconnects after its first tokens (0: never).
    disconnect_every: int = 10
    request_timeout_s: float = 180.0
    drain_timeout_s: float = 60.0
    model: str = "tiny-moe"
    api_key: str | None = None
    seed: int = 0


@dataclass
class RoundResult:
    round: int
    duration_s: float
    requests: int
    outcomes: dict[str, int]
    errors: list[str]
    output_tokens: int
    tokens_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    drained_s: float
    running_after: float
    waiting_after: float
    kv_usage_after: float
    rss_mb: dict[str, float] = field(default_factory=dict)

    @property
    def rss_total_mb(self) -> float:
        return sum(self.rss_mb.values())

    @property
    def unaccounted(self) -> int:
        return self.requests - sum(self.outcomes.values())


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def metric_values(base_url: str, name: str) -> list[float]:
    """Every series of metric `name` on the server's `/metrics`, in the order listed."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]


def metric(base_url: str, name: str) -> float:
    values = metric_values(base_url, name)
    return values[0] if values else float("nan")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _prompts(config: LoadConfig) -> list[str]:
    rng = random.Random(config.seed)
    return [
        " ".join(f"w{rng.randint(0, 999)}" for _ in range(rng.randint(1, config.max_prompt_words)))
        for _ in range(config.prompt_pool)
    ]


class _Round:
    def __init__(self, base_url: str, config: LoadConfig, index: int, prompts: list[str]):
        self.base_url = base_url
        self.config = config
        self.index = index
        self.prompts = prompts
        self.outcomes = {name: 0 for name in OUTCOMES}
        self.errors: list[str] = []
        self.requests = 0
        self.output_tokens = 0
        self.latencies: list[float] = []
        self.ttfts: list[float] = []

    def _error(self, message: str) -> None:
        self.outcomes["error"] += 1
        if len(self.errors) < 20:
            self.errors.append(message)

    async def _one(self, http: httpx.AsyncClient, rng: random.Random, disconnect: bool) -> float:
        """One request; returns how long to back off before the next one."""
        cfg = self.config
        max_tokens = rng.randint(cfg.min_tokens, cfg.max_tokens)
        prompt = rng.choice(self.prompts)
        body = {
            "model": cfg.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
            "seed": rng.randint(0, 2**31), "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }
        self.requests += 1
        start = time.perf_counter()
        first = None
        finished = done = False
        usage = None
        try:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code in (429, 503):
                    payload = json.loads(await response.aread())
                    if not payload.get("error", {}).get("message"):
                        self._error(f"{response.status_code} without an error message")
                    else:
                        self.outcomes[f"rejected_{response.status_code}"] += 1
                    return rng.uniform(0.05, 0.25)
                if response.status_code != 200:
                    self._error(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                    return 0.1
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        self._error(f"error event: {chunk['error'].get('message', '')[:200]}")
                        return 0.1
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        if choice.get("text") and first is None:
                            first = time.perf_counter()
                            if disconnect:
                                self.outcomes["disconnected"] += 1
                                return 0.0  # leaving the block closes the connection mid-stream
                        if choice.get("finish_reason"):
                            finished = True
        except (httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:
            self._error(f"{type(exc).__name__}: {exc}"[:200])
            return 0.1
        if not (done and finished and usage):
            self._error(f"stream ended without a finish reason, usage and [DONE] (done={done}, finished={finished})")
            return 0.1
        if usage.get("completion_tokens") != max_tokens:
            self._error(f"asked for {max_tokens} tokens, got {usage.get('completion_tokens')}")
            return 0.1
        self.outcomes["completed"] += 1
        self.output_tokens += max_tokens
        self.latencies.append(time.perf_counter() - start)
        if first is not None:
            self.ttfts.append(first - start)
        return 0.0

    async def _client(self, http: httpx.AsyncClient, client_id: int, deadline: float) -> None:
        rng = random.Random(self.config.seed * 1_000_003 + self.index * 10_007 + client_id)
        n = 0
        while time.monotonic() < deadline:
            n += 1
            every = self.config.disconnect_every
            disconnect = every > 0 and (n + client_id) % every == 0
            try:
                backoff = await asyncio.wait_for(self._one(http, rng, disconnect), self.config.request_timeout_s)
            except asyncio.TimeoutError:
                self._error(f"no answer within {self.config.request_timeout_s:g} s")
                backoff = 0.1
            if backoff:
                await asyncio.sleep(backoff)

    async def run(self) -> float:
        cfg = self.config
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        # No keep-alive: a pooled connection that sat idle up to the server's keep-alive
        # timeout can be closed by the server just as a request goes out on it (a ReadError
        # that is the client's race, not a lost request).
        limits = httpx.Limits(max_connections=cfg.clients + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.base_url, headers=headers, limits=limits,
                                     timeout=httpx.Timeout(cfg.request_timeout_s, connect=30)) as http:
            start = time.monotonic()
            deadline = start + cfg.round_s
            await asyncio.gather(*(self._client(http, i, deadline) for i in range(cfg.clients)))
            return time.monotonic() - start


def _drain(base_url: str, timeout_s: float, stable_s: float = 0.6) -> tuple[float, float, float, float]:
    """Wait until nothing runs, waits or holds KV (for `stable_s`, longer than the 0.25 s
    between engine stats reports); returns (seconds, running, waiting, kv)."""
    start = time.monotonic()
    idle_since = None
    while True:
        running = metric(base_url, "tandem_engine_requests_running")
        waiting = metric(base_url, "tandem_engine_requests_waiting")
        kv = metric(base_url, "tandem_engine_kv_usage_ratio")
        now = time.monotonic()
        if (running, waiting, kv) == (0, 0, 0):
            idle_since = now if idle_since is None else idle_since
            if now - idle_since >= stable_s:
                return idle_since - start, running, waiting, kv
        else:
            idle_since = None
        if now - start > timeout_s:
            return now - start, running, waiting, kv
        time.sleep(0.1)


def run_load(
    base_url: str,
    config: LoadConfig,
    pids: Callable[[], dict[str, int]] | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> list[RoundResult]:
    """Run `config.rounds` rounds against the server at `base_url`; `pids()` names the
    server's processes whose resident memory is recorded after each round."""
    results = []
    prompts = _prompts(config)
    for index in range(config.rounds):
        round_ = _Round(base_url, config, index, prompts)
        duration = asyncio.run(round_.run())
        drained, running, waiting, kv = _drain(base_url, config.drain_timeout_s)
        memory = {}
        for name, pid in (pids() if pids else {}).items():
            value = rss_mb(pid)
            if value is not None:
                memory[name] = value
        result = RoundResult(
            round=index + 1,
            duration_s=duration,
            requests=round_.requests,
            outcomes=dict(round_.outcomes),
            errors=round_.errors,
            output_tokens=round_.output_tokens,
            tokens_per_s=round_.output_tokens / duration if duration > 0 else 0.0,
            latency_p50_s=_percentile(round_.latencies, 0.5),
            latency_p99_s=_percentile(round_.latencies, 0.99),
            ttft_p50_s=_percentile(round_.ttfts, 0.5),
            ttft_p99_s=_percentile(round_.ttfts, 0.99),
            drained_s=drained,
            running_after=running,
            waiting_after=waiting,
            kv_usage_after=kv,
            rss_mb=memory,
        )
        log(format_round(result))
        results.append(result)
    return results


def format_round(r: RoundResult) -> str:
    o = r.outcomes
    return (
        f"round {r.round}: {r.requests} requests in {r.duration_s:.1f} s | completed {o['completed']} "
        f"rejected 429 {o['rejected_429']} 503 {o['rejected_503']} disconnected {o['disconnected']} "
        f"errors {o['error']} unaccounted {r.unaccounted} | {r.tokens_per_s:.0f} tok/s, latency p50 "
        f"{r.latency_p50_s:.2f} s p99 {r.latency_p99_s:.2f} s | after: running {r.running_after:g} waiting "
        f"{r.waiting_after:g} kv {r.kv_usage_after:g} (drained in {r.drained_s:.1f} s) | RSS {r.rss_total_mb:.0f} MB"
    )


def as_dict(r: RoundResult) -> dict:
    out = asdict(r)
    out["rss_total_mb"] = r.rss_total_mb
    out["unaccounted"] = r.unaccounted
    return out


__all__ = ["LoadConfig", "RoundResult", "as_dict", "format_round", "metric", "rss_mb", "run_load"]
