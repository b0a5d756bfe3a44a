"""Load test: hundreds of concurrent streaming clients against `tandem serve` with DBO on and a
request cap, for several rounds; nothing may be lost and nothing may leak.

Each client loops for the round's length: a streaming completion of random length
(`ignore_eos`, so the exact token count is known), every n-th one abandoned mid-stream on
purpose; a 429/503 answer makes it back off briefly and go on (see `tandem.testing.load`).
After every round the engine must drain to no running request and no KV in use, and the
resident memory of the server's processes is recorded: it must not keep growing.

    python benchmarks/load.py                               # 256 clients, 4 rounds of 45 s
    python benchmarks/load.py --clients 512 --rounds 5 --round-s 30 --max-queue-len 256

Prints one line per round and a table; writes benchmarks/results/load.json. Exits 1 when a
request was lost or failed, the engine did not drain, or memory grew past the tolerance.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
from tandem.testing.load import LoadConfig, as_dict, metric, run_load  # noqa: E402
from tandem.testing.server_process import Server, pid_alive, rank_pids  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--round-s", type=float, default=45.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--max-queue-len", type=int, default=192)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--disconnect-every", type=int, default=10)
    parser.add_argument("--rss-tolerance", type=float, default=0.10, help="Allowed growth after round 2 (fraction)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "load.json")
    args = parser.parse_args()

    flags = [
        "--data-parallel-size", str(args.data_parallel_size), "--enable-dbo",
        "--dbo-decode-token-threshold", "8", "--dbo-prefill-token-threshold", "64",
        "--max-queue-len", str(args.max_queue_len), "--max-num-seqs", str(args.max_num_seqs),
        "--kv-cache-tokens", "16384",
    ]
    config = LoadConfig(
        clients=args.clients, round_s=args.round_s, rounds=args.rounds, min_tokens=args.min_tokens,
        max_tokens=args.max_tokens, disconnect_every=args.disconnect_every,
    )
    print(f"tandem serve tiny-moe {' '.join(flags)}", file=sys.stderr)
    started = time.time()
    with Server("tiny-moe", *flags, startup_timeout_s=300) as server:

        def pids() -> dict[str, int]:
            return {"front end": server.proc.pid, **{f"child {p}": p for p in rank_pids([server.proc.pid])}}

        rounds = run_load(server.base, config, pids, log=lambda line: print(line, file=sys.stderr, flush=True))
        healthy = httpx.get(f"{server.base}/health", timeout=10).status_code == 200
        ubatched = metric(server.base, "tandem_engine_ubatched_steps_total")
        steps = metric(server.base, "tandem_engine_steps_total")
        children = server.children
        code = server.stop()
    deadline = time.monotonic() + 5  # helpers such as multiprocessing's resource tracker exit just after
    while [pid for pid in children if pid_alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = [pid for pid in children if pid_alive(pid)]

    header = ("round", "requests", "completed", "429", "503", "walked away", "errors", "lost", "tok/s",
              "p50 s", "p99 s", "KV after", "RSS MB")
    rows = [
        (r.round, r.requests, r.outcomes["completed"], r.outcomes["rejected_429"], r.outcomes["rejected_503"],
         r.outcomes["disconnected"], r.outcomes["error"], r.unaccounted, f"{r.tokens_per_s:.0f}",
         f"{r.latency_p50_s:.2f}", f"{r.latency_p99_s:.2f}", f"{r.kv_usage_after:g}", f"{r.rss_total_mb:.0f}")
        for r in rounds
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")

    growth = (rounds[-1].rss_total_mb / rounds[1].rss_total_mb - 1) if len(rounds) > 2 else 0.0
    problems = []
    if any(r.outcomes["error"] or r.unaccounted for r in rounds):
        problems.append("requests failed or were lost")
    if any((r.running_after, r.waiting_after, r.kv_usage_after) != (0, 0, 0) for r in rounds):
        problems.append("the engine did not drain after a round")
    if growth > args.rss_tolerance:
        problems.append(f"memory grew {100 * growth:.1f} % after round 2")
    if not healthy:
        problems.append("/health was not 200 after the load")
    if orphans or code not in (0, 130):
        problems.append(f"shutdown: exit code {code}, orphans {orphans}")
    print(f"DBO steps: {ubatched:.0f} of {steps:.0f}; RSS growth after round 2: {100 * growth:+.1f} %; "
          f"clean shutdown: {not orphans and code in (0, 130)}; " + ("; ".join(problems) if problems else "all good"))

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "command": "python benchmarks/load.py " + " ".join(sys.argv[1:]),
        "serve_flags": flags,
        "config": vars(args) | {"json": str(args.json)},
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
        "started": started,
        "rounds": [as_dict(r) for r in rounds],
        "ubatched_steps": ubatched,
        "steps": steps,
        "rss_growth_after_round_2": growth,
        "healthy_after": healthy,
        "orphans": orphans,
        "problems": problems,
    }, indent=2) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
