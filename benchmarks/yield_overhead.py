"""Cost of one `dbo_yield` handover per executor, next to the raw floor measured in the
same run: a bare two-lock thread handoff for `thread`, a bare greenlet switch for `greenlet`.

    python benchmarks/yield_overhead.py [--switches 20000] [--runs 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import greenlet

from tandem import dbo_yield, run_ubatches
from tandem.contexts import make_executor


def bare_thread_handoff(switches: int) -> float:
    """Seconds per handoff between two worker threads ping-ponging through two locks
    (worker threads on both sides, as with the executor's ubatches)."""
    ping, pong = threading.Lock(), threading.Lock()
    ping.acquire()
    pong.acquire()
    rounds = switches // 2
    timing = []

    def first() -> None:
        start = time.perf_counter()
        for _ in range(rounds):
            pong.release()
            ping.acquire()
        timing.append(time.perf_counter() - start)

    def second() -> None:
        for _ in range(rounds):
            pong.acquire()
            ping.release()

    threads = [threading.Thread(target=second), threading.Thread(target=first)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return timing[0] / (2 * rounds)


def bare_greenlet_switch(switches: int) -> float:
    rounds = switches // 2
    main = greenlet.getcurrent()

    def partner() -> None:
        for _ in range(rounds):
            main.switch()

    other = greenlet.greenlet(partner)
    start = time.perf_counter()
    for _ in range(rounds):
        other.switch()
    elapsed = time.perf_counter() - start
    other.switch()  # let it finish
    return elapsed / (2 * rounds)


def dbo_yield_switch(executor, switches: int) -> float:
    """Seconds per `dbo_yield` handover with two ubatches (each yields switches/2 times)."""
    per_ubatch = switches // 2

    def ubatch() -> None:
        for _ in range(per_ubatch):
            dbo_yield()

    start = time.perf_counter()
    run_ubatches([ubatch, ubatch], executor=executor)
    elapsed = time.perf_counter() - start
    return elapsed / (2 * per_ubatch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--switches", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "yield_overhead.json")
    args = parser.parse_args()

    cases = {
        "thread": (make_executor("thread"), bare_thread_handoff, "two-lock thread handoff"),
        "greenlet": (make_executor("greenlet"), bare_greenlet_switch, "bare greenlet switch"),
    }
    rows = []
    for name, (executor, floor_fn, floor_name) in cases.items():
        dbo_yield_switch(executor, 1000)  # warm the worker threads
        floors, yields = [], []
        for _ in range(args.runs):
            # Interleaved so both see the same machine state.
            floors.append(floor_fn(args.switches))
            yields.append(dbo_yield_switch(executor, args.switches))
        floor_us, yield_us = statistics.median(floors) * 1e6, statistics.median(yields) * 1e6
        rows.append(
            {
                "executor": name,
                "dbo_yield_us": round(yield_us, 3),
                "dbo_yield_spread_us": [round(min(yields) * 1e6, 3), round(max(yields) * 1e6, 3)],
                "floor": floor_name,
                "floor_us": round(floor_us, 3),
                "ratio": round(yield_us / floor_us, 3),
            }
        )

    print(f"{'executor':<10}{'dbo_yield µs':>14}{'floor µs':>11}{'ratio':>8}  floor")
    for r in rows:
        print(f"{r['executor']:<10}{r['dbo_yield_us']:>14.2f}{r['floor_us']:>11.2f}{r['ratio']:>8.2f}  {r['floor']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "rows": rows,
                "config": {
                    "switches": args.switches,
                    "runs": args.runs,
                    "python": platform.python_version(),
                    "machine": platform.machine(),
                },
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
