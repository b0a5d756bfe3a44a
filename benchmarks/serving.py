"""Serving throughput: overlapped vs normal scheduler loop, and DBO on vs off at dp 2.

Each configuration is a real `tandem serve` subprocess driven by the official `openai`
client with a fixed request mix (same prompts, lengths and seeds every run): C concurrent
streaming requests, each generating a fixed number of tokens (ignore_eos). Reported per
configuration, as the median over repeats: output tokens/s, mean time per output token
(TPOT, per request: (last token - first token) / (tokens - 1)) and the fraction of the
run's wall time the forward worker sat idle (1 - forward busy time / wall, from /metrics).

    python benchmarks/serving.py                      # both comparisons, 3 repeats
    python benchmarks/serving.py --repeat 5 --concurrency 32 --max-tokens 64

Ratios compare configurations measured in this one run. Results go to
benchmarks/results/serving.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
from tandem.testing.server_process import Server  # noqa: E402

CONFIGS = {
    "overlap loop (dp 1)": ("--kv-cache-tokens", "16384"),
    "normal loop (dp 1)": ("--kv-cache-tokens", "16384", "--disable-overlap-schedule"),
    "DBO off (dp 2)": ("--kv-cache-tokens", "16384", "--data-parallel-size", "2"),
    "DBO on (dp 2)": (
        "--kv-cache-tokens", "16384", "--data-parallel-size", "2", "--enable-dbo",
        "--dbo-decode-token-threshold", "8", "--dbo-prefill-token-threshold", "64",
    ),
}
COMPARISONS = [("overlap loop (dp 1)", "normal loop (dp 1)"), ("DBO on (dp 2)", "DBO off (dp 2)")]


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def _drive(url: str, concurrency: int, max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    async def one(i: int) -> tuple[int, float]:
        first = last = None
        count = 0
        stream = await client.completions.create(
            model="tiny-moe", prompt=f"request {i}: " + "mixture of experts " * (1 + i % 7), max_tokens=max_tokens,
            temperature=0.8, seed=i, stream=True, extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                now = time.perf_counter()
                first = first or now
                last = now
                count += 1
        return count, (last - first) / max(count - 1, 1)

    start = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    finally:
        await client.close()
    wall = time.perf_counter() - start
    # Chunks can merge tokens, so count tokens from the server's own counter instead.
    return {"wall_s": wall, "tpot_ms": 1000 * statistics.mean(t for _, t in results)}


def measure(name: str, flags: tuple, args) -> dict:
    runs = []
    with Server("tiny-moe", *flags) as server:
        asyncio.run(_drive(server.url, 4, 4))  # warm the HTTP path
        for _ in range(args.repeat):
            tokens0 = _metric(server.base, "tandem_engine_generated_tokens_total")
            busy0 = _metric(server.base, "tandem_engine_forward_busy_seconds_total")
            result = asyncio.run(_drive(server.url, args.concurrency, args.max_tokens))
            time.sleep(0.6)  # let the ranks' stats (sent every 0.25 s) catch up
            tokens = _metric(server.base, "tandem_engine_generated_tokens_total") - tokens0
            busy = _metric(server.base, "tandem_engine_forward_busy_seconds_total") - busy0
            ranks = 2 if "--data-parallel-size" in flags else 1
            result.update(
                tokens=tokens,
                tokens_per_s=tokens / result["wall_s"],
                forward_idle=max(0.0, 1 - busy / ranks / result["wall_s"]),
            )
            runs.append(result)
            print(f"  {name}: {result['tokens_per_s']:.1f} tok/s, TPOT {result['tpot_ms']:.2f} ms, "
                  f"forward idle {100 * result['forward_idle']:.1f} %", file=sys.stderr)
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    return {"name": name, "flags": list(flags), "tokens_per_s": med("tokens_per_s"), "tpot_ms": med("tpot_ms"),
            "forward_idle": med("forward_idle"), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--only", choices=["loops", "dbo"], default=None)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "serving.json"))
    args = parser.parse_args()
    comparisons = COMPARISONS if args.only is None else COMPARISONS[:1] if args.only == "loops" else COMPARISONS[1:]
    rows = {}
    for pair in comparisons:
        for name in pair:
            rows[name] = measure(name, CONFIGS[name], args)
    print(f"\n{args.concurrency} concurrent streams x {args.max_tokens} tokens, median of {args.repeat}\n")
    print("| configuration | output tok/s | TPOT ms | forward idle |")
    print("|---|---:|---:|---:|")
    for row in rows.values():
        print(f"| {row['name']} | {row['tokens_per_s']:.1f} | {row['tpot_ms']:.2f} | {100 * row['forward_idle']:.1f} % |")
    print()
    for a, b in comparisons:
        print(f"{a} / {b}: {rows[a]['tokens_per_s'] / rows[b]['tokens_per_s']:.2f}x tokens/s")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"config": vars(args), "rows": list(rows.values())}, indent=2))


if __name__ == "__main__":
    main()
