"""A flood of distinct JSON schemas against `tandem serve` (an agent that sends a new tool
schema per call): does the rank stay within `--grammar-cache-mb`?

One rank of tiny-moe; `--schemas` chat completions (`max_tokens` 1, `--clients` at a time),
each with a `response_format` json_schema no other request sends, so each compiles a grammar
the rank may keep only while the cache holds under the bound. Every `--every` requests the
rank's and the head's resident memory are sampled. The goal (#34): the rank's growth over its
memory before the flood stays within the bound + 5 %. A last round re-sends the newest
schemas (cache hits) and must add nothing.

    python benchmarks/grammar_flood.py --schemas 100000 [--grammar-cache-mb 512]

Prints a table and writes benchmarks/results/grammar_flood.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
from tandem.testing.load import rss_mb  # noqa: E402
from tandem.testing.server_process import Server  # noqa: E402
from tandem.testing.soak import new_schema, server_processes  # noqa: E402


async def send(base: str, schemas: list[dict], clients: int) -> dict[int, int]:
    """Each schema once, `clients` at a time; the HTTP status counts."""
    statuses: dict[int, int] = {}
    gate = asyncio.Semaphore(clients)
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=httpx.Timeout(120, connect=30)) as http:
        async def one(schema: dict) -> None:
            async with gate:
                body = {"model": "tiny-moe", "max_tokens": 1, "temperature": 0,
                        "messages": [{"role": "user", "content": "JSON please"}],
                        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
                status = (await http.post("/v1/chat/completions", json=body)).status_code
                statuses[status] = statuses.get(status, 0) + 1

        await asyncio.gather(*(one(s) for s in schemas))
    return statuses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemas", type=int, default=100_000)
    parser.add_argument("--grammar-cache-mb", type=int, default=512, help="The bound under test (512: the default).")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--every", type=int, default=5_000, help="Sample memory every this many requests.")
    parser.add_argument("--note", default="", help="What else ran on the machine, for the JSON record.")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "grammar_flood.json")
    args = parser.parse_args()
    # A SIGTERM (a stopped job) unwinds like Ctrl-C, so the server this started is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    rng = random.Random(0)
    rows, statuses = [], {}
    with Server("tiny-moe", "--grammar-cache-mb", str(args.grammar_cache_mb), startup_timeout_s=300) as server:
        rank = next(pid for name, pid in server_processes(server.proc.pid).items() if name.startswith("rank"))

        def sample(sent: int, phase: str) -> None:
            rows.append({"sent": sent, "phase": phase, "rank_rss_mb": rss_mb(rank), "head_rss_mb": rss_mb(server.proc.pid),
                         "t": time.time()})
            growth = rows[-1]["rank_rss_mb"] - rows[0]["rank_rss_mb"]
            print(f"{phase:>8} {sent:>7} rank {rows[-1]['rank_rss_mb']:7.1f} MB ({growth:+6.1f}) "
                  f"head {rows[-1]['head_rss_mb']:7.1f} MB  {statuses}", file=sys.stderr, flush=True)

        # Warm the server's paths (one constrained request, a few plain ones) before the baseline.
        asyncio.run(send(server.base, [new_schema(rng) for _ in range(8)], args.clients))
        sample(0, "before")
        sent, recent = 0, []
        started = time.monotonic()
        while sent < args.schemas:
            batch = [new_schema(rng) for _ in range(min(args.every, args.schemas - sent))]
            for status, count in asyncio.run(send(server.base, batch, args.clients)).items():
                statuses[status] = statuses.get(status, 0) + count
            sent += len(batch)
            recent = batch[-200:]
            sample(sent, "flood")
        flood_s = time.monotonic() - started
        for status, count in asyncio.run(send(server.base, recent * 3, args.clients)).items():
            statuses[f"repeat {status}"] = statuses.get(f"repeat {status}", 0) + count
        sample(sent, "repeats")

    bound = args.grammar_cache_mb
    growth = max(r["rank_rss_mb"] for r in rows) - rows[0]["rank_rss_mb"]
    repeat_growth = rows[-1]["rank_rss_mb"] - rows[-2]["rank_rss_mb"]
    met = growth <= 1.05 * bound and all(str(s).endswith("200") for s in statuses)
    print(f"\n{sent} distinct schemas in {flood_s / 60:.1f} min ({sent / flood_s:.0f}/s): rank RSS grew at most "
          f"{growth:.1f} MB for a {bound} MB bound (goal <= {1.05 * bound:.1f}): {'met' if met else 'MISSED'}; "
          f"600 repeats of cached schemas: {repeat_growth:+.1f} MB; statuses {statuses}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "command": "python benchmarks/grammar_flood.py " + " ".join(sys.argv[1:]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "note": args.note},
        "grammar_cache_mb": bound, "schemas": sent, "flood_s": flood_s, "statuses": statuses,
        "rank_growth_mb": growth, "repeat_growth_mb": repeat_growth, "goal_met": met, "samples": rows,
    }, indent=2) + "\n")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
