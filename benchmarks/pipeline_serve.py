"""Pipeline parallelism through `tandem serve`: pp1 vs pp2 output tokens/s as a user sees them.

Each configuration is a real `tandem serve` subprocess driven by the official `openai` client:
S concurrent streaming completions (same prompts and seeds every run, `ignore_eos`) of a fixed
number of tokens each. tok/s is the tokens the server generated (its /metrics counter) over the
client's wall time for the whole batch of streams. Configurations are interleaved per repeat
(each server is started once and kept), the table shows the median (min-max) over `--repeat`
runs, ratios from those medians.

    python benchmarks/pipeline_serve.py                        # tiny-moe, 8 and 64 streams
    python benchmarks/pipeline_serve.py --streams 64 --repeat 5

Writes benchmarks/results/pipeline_serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.support.server_process import Server  # noqa: E402

CONFIGS = {
    "pp1": (),
    "pp2": ("--pipeline-parallel-size", "2"),
}


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def _drive(url: str, model: str, streams: int, max_tokens: int) -> float:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    async def one(i: int) -> None:
        stream = await client.completions.create(
            model=model, prompt=f"request {i}: " + "pipeline stages " * (1 + i % 5), max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            pass

    start = time.perf_counter()
    try:
        await asyncio.gather(*(one(i) for i in range(streams)))
    finally:
        await client.close()
    return time.perf_counter() - start


def _run(server: Server, model: str, streams: int, max_tokens: int) -> float:
    before = _metric(server.base, "tandem_engine_generated_tokens_total")
    wall = asyncio.run(_drive(server.url, model, streams, max_tokens))
    deadline = time.monotonic() + 5
    while True:  # the ranks report their counters every 0.25 s
        tokens = _metric(server.base, "tandem_engine_generated_tokens_total") - before
        if tokens >= streams * max_tokens or time.monotonic() > deadline:
            return tokens / wall
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--extra", default="", help="More serve flags for every configuration, space separated.")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "pipeline_serve.json")
    args = parser.parse_args()
    started = time.time()
    common = ("--kv-cache-tokens", "16384", "--max-num-seqs", str(max(args.streams)), *args.extra.split())
    runs: dict[str, dict[int, list[float]]] = {name: {s: [] for s in args.streams} for name in args.configs}
    with contextlib.ExitStack() as stack:
        servers = {}
        for name in args.configs:
            servers[name] = stack.enter_context(Server(args.model, *common, *CONFIGS[name], startup_timeout_s=600))
            asyncio.run(_drive(servers[name].url, args.model, 4, 8))  # warm the HTTP path
        for r in range(args.repeat):
            for streams in args.streams:
                for name in args.configs:
                    runs[name][streams].append(_run(servers[name], args.model, streams, args.max_tokens))
                    print(f"[pipeline serve] run {r + 1} {name} {streams} streams: {runs[name][streams][-1]:.0f} tok/s",
                          file=sys.stderr, flush=True)
        logs = {name: server.output() for name, server in servers.items()}
    rows = []
    print(f"\n{args.model} through `tandem serve`, {args.max_tokens} tokens per stream, median of {args.repeat} (min-max)")
    print(f"{'config':<8} {'streams':>7} {'tok/s':>8} {'min-max':>13} {'vs pp1':>7}")
    for streams in args.streams:
        base = statistics.median(runs["pp1"][streams]) if "pp1" in runs else None
        for name in args.configs:
            values = runs[name][streams]
            median = statistics.median(values)
            ratio = median / base if base else None
            rows.append({"config": name, "streams": streams, "tok_s": median, "min": min(values), "max": max(values),
                         "vs_pp1": ratio, "runs": values})
            ratio_text = f"{ratio:.2f}x" if ratio else "-"
            print(f"{name:<8} {streams:>7} {median:>8.0f} {min(values):>6.0f}-{max(values):<6.0f} {ratio_text:>7}")
    notes = [line for text in logs.values() for line in text.splitlines() if "pipeline parallelism" in line]
    for line in notes:
        print(f"  server said: {line}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "rows": rows, "server_notes": notes, "wall_s": time.time() - started,
    }, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
