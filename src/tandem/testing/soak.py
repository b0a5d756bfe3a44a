"""A soak for `tandem serve`: waves of concurrent requests of every kind a deployment sees,
with every request accounted for and the server checked for leaks between waves.

A wave sends `wave_requests` requests, `clients` at a time, each of a kind drawn at random:

- stream: a streamed completion (`ignore_eos`): it must end with a finish reason, the usage
  and `[DONE]`, with exactly `max_tokens` tokens;
- hangup: the client walks away after the first tokens (the server must abort it);
- abort: the client gives up after a few milliseconds, before or around its first token;
- n: a streamed completion with `n` > 1: every choice must finish;
- long: a prompt long enough to be prefilled in chunks, and (with a small KV cache, several
  at once) to make the scheduler preempt;
- json: a chat completion with `response_format` json_schema; a reply that stops (rather
  than running out of tokens) must validate against the schema;
- logprobs: a streamed completion with `logprobs`: every token chunk carries them.

Every `adversarial_every`-th wave is adversarial: each request carries input no other request
sends, so whatever the server keeps per distinct input shows up as growth:

- schema: a chat completion whose `json_schema` is new (an agent's per-call tool schema);
- grammar_hangup: the same, streamed, and the client walks away mid-grammar;
- stop: a streamed completion with new stop strings: it ends on one of them or at
  `max_tokens`, and its text holds none of them;
- bias: a streamed completion with a new `logit_bias` map (up to 300 ids);
- and the long prompts that preempt and `n` > 1 of the ordinary mix.

Each request ends as one outcome: finished, hung_up, aborted, `status_<code>` (the server
answered an HTTP error), `error_event` (a stream that ended with an error event) or `lost`
(anything else: a cut stream, a transport error, a timeout, a reply that breaks its
contract). After each wave the engine must return to no running or waiting request and no
KV in use (`/metrics`, vLLM's names), and the resident memory and open file descriptors of
every server process are recorded: after the warm-up they must not grow. The warm-up is
measured, not assumed (`warmup_waves`): the waves before the memory curve joins the straight
line fitted to the second half of the run, as bounded caches (compiled grammars, the
tokenizer's) fill and the allocators reach their working set.

`run_wave` drives one wave; `benchmarks/soak.py` (minutes of waves) and
`tests/serving/test_soak.py` (a short run) use it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import httpx

from tandem.simulate.line_fit import fit_line
from tandem.testing.load import metric_values, rss_mb

#: The deployment the soak runs against (`tandem serve tiny-moe ...`): two DBO ranks, a KV
#: cache two long prompts cannot share, a step budget that chunks them.
SERVE_FLAGS = (
    "--data-parallel-size", "2", "--enable-dbo", "--dbo-decode-token-threshold", "8",
    "--dbo-prefill-token-threshold", "64", "--kv-cache-tokens", "1024", "--max-num-batched-tokens", "256",
    # Small enough that the adversarial waves' new schemas fill it within the warm-up.
    "--grammar-cache-mb", "4",
)
KINDS = {"stream": 4, "hangup": 2, "abort": 1, "n": 1, "long": 1, "json": 1, "logprobs": 1}
ADVERSARIAL_KINDS = {"schema": 2, "grammar_hangup": 1, "stop": 2, "bias": 2, "long": 1, "n": 1}
#: Token ids a `logit_bias` map may name: tiny-moe's 256 byte tokens.
BIAS_IDS = 256
OUTCOMES = ("finished", "hung_up", "aborted", "error_event", "lost")
JSON_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@dataclass
class SoakConfig:
    clients: int = 16
    wave_requests: int = 64
    max_tokens: int = 24
    #: Words of a "long" prompt (about five tokens each with tiny-moe's tokenizer).
    long_prompt_words: int = 120
    #: Distinct short and long prompts every request draws from. Bounded on purpose: the
    #: tokenizer caches the encodings of up to 10,000 distinct prompts, a bounded cache that
    #: would otherwise read as memory growth over the first thousands of requests.
    prompt_pool: int = 64
    long_prompt_pool: int = 8
    request_timeout_s: float = 120.0
    drain_timeout_s: float = 60.0
    model: str = "tiny-moe"
    seed: int = 0
    #: Every this many waves one is adversarial (0: none).
    adversarial_every: int = 3

    def is_adversarial(self, index: int) -> bool:
        return self.adversarial_every > 0 and index % self.adversarial_every == self.adversarial_every - 1


@dataclass
class WaveResult:
    wave: int
    adversarial: bool
    duration_s: float
    requests: int
    outcomes: dict[str, int]
    kinds: dict[str, int]
    problems: list[str]
    drained_s: float
    running_after: float
    waiting_after: float
    kv_usage_after: float
    preemptions_total: float
    rss_mb: dict[str, float] = field(default_factory=dict)
    open_fds: dict[str, int] = field(default_factory=dict)
    #: Wall-clock time of the memory samples (after the drain).
    sampled_at: float = 0.0

    @property
    def rss_total_mb(self) -> float:
        return sum(self.rss_mb.values())

    @property
    def fds_total(self) -> int:
        return sum(self.open_fds.values())

    @property
    def unaccounted(self) -> int:
        return self.requests - sum(self.outcomes.values())

    @property
    def server_errors(self) -> int:
        """5xx answers and error events: a correct server under this load gives none."""
        return self.outcomes.get("error_event", 0) + sum(
            count for name, count in self.outcomes.items() if name.startswith("status_5"))


def engine_metric(base_url: str, name: str, combine: Callable[[list[float]], float] = sum) -> float:
    """One of vLLM's per-engine metrics (`engine` label), combined over the engines."""
    values = metric_values(base_url, name)
    return combine(values) if values else float("nan")


def server_processes(head_pid: int) -> dict[str, int]:
    """The server's processes by role: the head, its rank processes, and multiprocessing's
    resource tracker (which holds nothing of ours but is sampled like the rest)."""
    from tandem.testing.server_process import rank_pids

    named = {"head": head_pid}
    for pid in rank_pids([head_pid]):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                tracker = b"resource_tracker" in cmdline.read()
        except OSError:
            continue
        named[f"{'resource tracker' if tracker else 'rank'} (pid {pid})"] = pid
    return named


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


class _Lost(Exception):
    """The request broke its contract: counted as `lost`, with this message as the problem."""


class _Ended(Exception):
    """A streamed request ended with an HTTP error status or an error event: its outcome."""

    def __init__(self, outcome: str):
        super().__init__(outcome)
        self.outcome = outcome


async def _sse_chunks(response: httpx.Response):
    """The JSON chunks of a streamed reply, in order; `_Ended` for an HTTP error or an error event."""
    if response.status_code != 200:
        await response.aread()
        raise _Ended(f"status_{response.status_code}")
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            raise _Ended("error_event")
        yield chunk


def _prompt_pools(config: SoakConfig) -> dict[bool, list[str]]:
    """Short (False) and long (True) prompts, the same for every wave of a run."""
    rng = random.Random(config.seed)

    def prompt(words: int) -> str:
        return " ".join(f"w{rng.randint(0, 999)}" for _ in range(words))

    return {False: [prompt(rng.randint(1, 16)) for _ in range(config.prompt_pool)],
            True: [prompt(config.long_prompt_words) for _ in range(config.long_prompt_pool)]}


class _Wave:
    def __init__(self, base_url: str, config: SoakConfig, index: int):
        self.base_url, self.config, self.index = base_url, config, index
        self.prompts = _prompt_pools(config)
        self.outcomes: dict[str, int] = {name: 0 for name in OUTCOMES}
        self.adversarial = config.is_adversarial(index)
        self.mix = ADVERSARIAL_KINDS if self.adversarial else KINDS
        self.kinds: dict[str, int] = {name: 0 for name in self.mix}
        self.problems: list[str] = []

    def _count(self, outcome: str, problem: str | None = None) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if problem and len(self.problems) < 20:
            self.problems.append(problem)

    async def run(self) -> float:
        rng = random.Random(self.config.seed * 1_000_003 + self.index)
        kinds = rng.choices(list(self.mix), weights=list(self.mix.values()), k=self.config.wave_requests)
        seeds = [rng.randrange(2**31) for _ in kinds]
        gate = asyncio.Semaphore(self.config.clients)
        # No keep-alive: an idle pooled connection the server closes as a request goes out on
        # it is the client's race, not a lost request.
        limits = httpx.Limits(max_connections=self.config.clients + 4, max_keepalive_connections=0)
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=30)
        async with httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=timeout) as http:
            start = time.monotonic()
            await asyncio.gather(*(self._guarded(http, gate, kind, seed) for kind, seed in zip(kinds, seeds)))
            return time.monotonic() - start

    async def _guarded(self, http: httpx.AsyncClient, gate: asyncio.Semaphore, kind: str, seed: int) -> None:
        async with gate:
            self.kinds[kind] += 1
            rng = random.Random(seed)
            try:
                if kind == "abort":
                    await self._abort(http, rng)
                    return
                self._count(await asyncio.wait_for(self._request(http, kind, rng), self.config.request_timeout_s))
            except _Lost as exc:
                self._count("lost", f"{kind}: {exc}")
            except (httpx.HTTPError, asyncio.TimeoutError, ValueError, KeyError) as exc:
                self._count("lost", f"{kind}: {type(exc).__name__}: {exc}"[:240])

    async def _abort(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        try:
            outcome = await asyncio.wait_for(self._request(http, "stream", rng), rng.uniform(0.005, 0.08))
        except asyncio.TimeoutError:
            outcome = "aborted"
        self._count(outcome)

    async def _request(self, http: httpx.AsyncClient, kind: str, rng: random.Random) -> str:
        try:
            return await self._attempt(http, kind, rng)
        except _Ended as ended:
            return ended.outcome

    async def _attempt(self, http: httpx.AsyncClient, kind: str, rng: random.Random) -> str:
        if kind in ("json", "schema"):
            return await self._json(http, rng, JSON_SCHEMA if kind == "json" else new_schema(rng))
        if kind == "grammar_hangup":
            return await self._grammar_hangup(http, rng)
        cfg = self.config
        max_tokens = rng.randint(2, cfg.max_tokens)
        n = rng.randint(2, 3) if kind == "n" else 1
        body = {
            "model": cfg.model, "prompt": rng.choice(self.prompts[kind == "long"]),
            "max_tokens": max_tokens, "temperature": 0.8, "seed": rng.randrange(2**31), "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "n": n,
        }
        if kind == "logprobs":
            body["logprobs"] = 2
        if kind == "stop":
            body["stop"] = new_stop_strings(rng)
        if kind == "bias":
            body["logit_bias"] = new_logit_bias(rng)
        finished: set[int] = set()
        reasons: set[str] = set()
        text = ""
        usage = None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for chunk in _sse_chunks(response):
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    if kind == "logprobs" and choice.get("text") and not (choice.get("logprobs") or {}).get("tokens"):
                        raise _Lost("a token chunk without logprobs")
                    text += choice.get("text") or ""
                    if choice.get("finish_reason"):
                        finished.add(choice["index"])
                        reasons.add(choice["finish_reason"])
                    elif choice.get("text") and kind == "hangup":
                        return "hung_up"  # leaving the block closes the connection mid-stream
        if finished != set(range(n)) or usage is None:
            raise _Lost(f"stream ended with choices {sorted(finished)} of {n} finished, usage {usage}")
        if kind == "stop":
            held = [stop for stop in body["stop"] if stop in text]
            if held or not reasons <= {"stop", "length"} or usage["completion_tokens"] > max_tokens:
                raise _Lost(f"stop {body['stop']}: finish {reasons}, {usage['completion_tokens']} of {max_tokens} "
                            f"tokens, text holds {held}")
        elif usage["completion_tokens"] != n * max_tokens:
            raise _Lost(f"asked for {n} x {max_tokens} tokens, got {usage['completion_tokens']}")
        return "finished"

    def _chat_body(self, rng: random.Random, schema: dict) -> dict:
        return {
            "model": self.config.model, "max_tokens": 48, "temperature": 0.8, "seed": rng.randrange(2**31),
            "messages": [{"role": "user", "content": "Is it ok? Answer in JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        }

    async def _json(self, http: httpx.AsyncClient, rng: random.Random, schema: dict) -> str:
        import jsonschema

        response = await http.post("/v1/chat/completions", json=self._chat_body(rng, schema))
        if response.status_code != 200:
            return f"status_{response.status_code}"
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            try:
                jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                raise _Lost(f"structured output broke its schema: {exc}"[:200]) from None
        return "finished"

    async def _grammar_hangup(self, http: httpx.AsyncClient, rng: random.Random) -> str:
        body = self._chat_body(rng, new_schema(rng)) | {"stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for chunk in _sse_chunks(response):
                for choice in chunk.get("choices", []):
                    if (choice.get("delta") or {}).get("content"):
                        return "hung_up"  # mid-grammar: the constraint has advanced
                    if choice.get("finish_reason"):
                        return "finished"
        raise _Lost("a streamed structured reply ended without a finish reason")


def new_schema(rng: random.Random) -> dict:
    """A json_schema no other request sends: 1-4 properties under fresh names."""
    tag = rng.randrange(10**9)
    properties = {f"k{tag}_{i}": {"type": rng.choice(("integer", "boolean", "string"))} for i in range(rng.randint(1, 4))}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def new_stop_strings(rng: random.Random) -> list[str]:
    """1-4 stop strings of 1-3 printable characters: short enough that some match."""
    return ["".join(chr(rng.randint(0x21, 0x7E)) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 4))]


def new_logit_bias(rng: random.Random) -> dict[str, float]:
    """A map of up to 300 ids (the server's limit) with biases anywhere in [-100, 100]."""
    ids = rng.sample(range(BIAS_IDS), rng.randint(1, min(300, BIAS_IDS)))
    return {str(i): round(rng.uniform(-100, 100), 2) for i in ids}


def _settle(base_url: str, timeout_s: float, stable_s: float = 0.6) -> tuple[float, float, float, float]:
    """Wait until nothing runs, waits or holds KV for `stable_s` (longer than the 0.25 s
    between engine stats reports); returns (seconds, running, waiting, kv usage)."""
    start = time.monotonic()
    idle_since = None
    while True:
        values = (engine_metric(base_url, "vllm:num_requests_running"),
                  engine_metric(base_url, "vllm:num_requests_waiting"),
                  engine_metric(base_url, "vllm:kv_cache_usage_perc", max))
        now = time.monotonic()
        if values == (0, 0, 0):
            idle_since = now if idle_since is None else idle_since
            if now - idle_since >= stable_s:
                return (idle_since - start, *values)
        else:
            idle_since = None
        if now - start > timeout_s:
            return (now - start, *values)
        time.sleep(0.1)


def run_wave(base_url: str, config: SoakConfig, index: int, pids: Callable[[], dict[str, int]]) -> WaveResult:
    """One wave against the server at `base_url`, then the drain and the per-process samples
    (`pids()` names the server's processes)."""
    wave = _Wave(base_url, config, index)
    duration = asyncio.run(wave.run())
    drained, running, waiting, kv = _settle(base_url, config.drain_timeout_s)
    memory, fds = {}, {}
    for name, pid in pids().items():
        rss, count = rss_mb(pid), open_fds(pid)
        if rss is not None and count is not None:
            memory[name], fds[name] = rss, count
    return WaveResult(
        wave=index + 1, adversarial=wave.adversarial, duration_s=duration, requests=config.wave_requests,
        outcomes={k: v for k, v in wave.outcomes.items() if v or k in OUTCOMES}, kinds=wave.kinds,
        problems=wave.problems, drained_s=drained, running_after=running, waiting_after=waiting,
        kv_usage_after=kv, preemptions_total=engine_metric(base_url, "vllm:num_preemptions_total"), rss_mb=memory,
        open_fds=fds, sampled_at=time.time(),
    )


def warmup_waves(waves: list[WaveResult], min_waves: int = 12) -> int:
    """How many waves the warm-up took, measured: the waves before the total-RSS curve joins
    the least-squares line through the second half of the run and stays within three residual
    deviations (at least 1 MB) of it. The curve is a running median over a twentieth of the
    run (at least 3 waves): one wave's sample dips by several MB when an idle rank hands pages
    back, and a single dip must not read as the warm-up going on. Runs shorter than
    `min_waves` take the first wave."""
    if len(waves) < min_waves:
        return 1
    totals = _running_median([w.rss_total_mb for w in waves], max(3, len(waves) // 20))
    start = len(totals) // 2
    xs = range(start, len(totals))
    intercept, slope = fit_line(list(zip(xs, totals[start:])))
    residuals = [totals[x] - (intercept + slope * x) for x in xs]
    spread = max(3 * (sum(r * r for r in residuals) / len(residuals)) ** 0.5, 1.0)
    joined = len(totals)
    for x in range(len(totals) - 1, -1, -1):
        if totals[x] < intercept + slope * x - spread:
            break
        joined = x
    return max(joined, 1)


def _running_median(values: list[float], window: int) -> list[float]:
    """Each value replaced by the median of the `window` values ending at it (fewer at the start)."""
    return [statistics.median(values[max(0, i + 1 - window): i + 1]) for i in range(len(values))]


@dataclass
class Growth:
    """Memory and descriptors after the warm-up, as fractions (0.01: 1 % more): the mean of
    the last tenth of the measured waves (at least 3) over the mean of the first tenth, for
    the server as a whole and for its worst process. Means, because one wave's sample moves
    by a few MB as an idle rank hands freed pages back (`platform.heap`) and takes them again."""
    warmup: int
    rss: float
    fds: float
    worst_process: str
    worst_process_rss: float
    #: The steady trend: the slope of total RSS over the measured waves, in MB an hour.
    rss_mb_per_hour: float


def growth(waves: list[WaveResult], warmup: int | None = None) -> Growth:
    """Growth after `warmup` waves (measured by `warmup_waves` when None)."""
    warmup = warmup_waves(waves) if warmup is None else warmup
    measured = waves[warmup:]
    if len(measured) < 2:
        return Growth(warmup, 0.0, 0.0, "", 0.0, 0.0)
    window = max(min(3, len(measured) // 2), len(measured) // 10)
    first, last = measured[:window], measured[-window:]

    def rise(value: Callable[[WaveResult], float]) -> float:
        return sum(map(value, last)) / sum(map(value, first)) - 1

    per_process = {name: rise(lambda w, name=name: w.rss_mb.get(name, 0.0)) for name in measured[0].rss_mb}
    worst = max(per_process, key=per_process.get)
    hours = [sum(w.duration_s + w.drained_s for w in waves[: i + 1]) / 3600 for i in range(len(waves))]
    _, slope = fit_line(list(zip(hours[warmup:], (w.rss_total_mb for w in measured))))
    return Growth(
        warmup=warmup, rss=rise(lambda w: w.rss_total_mb), fds=rise(lambda w: w.fds_total),
        worst_process=worst, worst_process_rss=per_process[worst], rss_mb_per_hour=slope,
    )


HEADER = (f"{'wave':>4} {'reqs':>5} {'time s':>7} {'finished':>8} {'hung_up':>7} {'aborted':>7} {'http err':>8} "
          f"{'lost':>4} {'run/wait/kv':>11} {'preempt':>7} {'RSS MB':>7} {'fds':>4}")


def format_wave(w: WaveResult) -> str:
    o = w.outcomes
    http_errors = sum(v for k, v in o.items() if k.startswith("status_")) + o.get("error_event", 0)
    after = f"{w.running_after:g}/{w.waiting_after:g}/{w.kv_usage_after:g}"
    return (f"{w.wave:>3}{'A' if w.adversarial else ' '} {w.requests:>5} {w.duration_s:>7.1f} {o['finished']:>8} {o['hung_up']:>7} "
            f"{o['aborted']:>7} {http_errors:>8} {o['lost'] + w.unaccounted:>4} {after:>11} "
            f"{w.preemptions_total:>7g} {w.rss_total_mb:>7.0f} {w.fds_total:>4}")


def as_dict(w: WaveResult) -> dict:
    return {**asdict(w), "rss_total_mb": w.rss_total_mb, "fds_total": w.fds_total, "unaccounted": w.unaccounted}


__all__ = ["ADVERSARIAL_KINDS", "HEADER", "KINDS", "SERVE_FLAGS", "Growth", "SoakConfig", "WaveResult", "as_dict",
           "engine_metric", "format_wave", "growth", "new_logit_bias", "new_schema", "new_stop_strings", "open_fds",
           "run_wave", "server_processes", "warmup_waves"]
