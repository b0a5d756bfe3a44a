"""Where each process of `tandem serve` spends its time while streams run: py-spy samples every
process (front end and ranks, idle waits included) and the script prints, per process, the
share of its main thread's samples under each function (inclusive), so a wait on another
stage, the front end or the model's layers each show as a row.

    pip install py-spy
    python benchmarks/serve_profile.py -- --pipeline-parallel-size 2       # tiny-moe, 64 streams
    python benchmarks/serve_profile.py --model small-moe --seconds 30 --

Writes the raw collapsed stacks (one file per process) and a JSON summary under
benchmarks/results/serve_profile/ (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from pipeline_serve import _drive  # noqa: E402
from tandem.testing.server_process import Server  # noqa: E402


def inclusive_shares(raw: Path, thread: str = "MainThread") -> tuple[int, list[tuple[str, float]]]:
    """(samples, [(function (file), share of the thread's samples under it)]) from py-spy's raw output."""
    total, under = 0, collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or thread not in frames[0]:
            continue
        total += int(count)
        names = {f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")"
                 for f in frames[1:] if " (" in f}
        for name in names:
            under[name] += int(count)
    return total, [(name, n / total) for name, n in under.most_common()] if total else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve_profile")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then more `tandem serve` flags")
    args = parser.parse_args()
    if shutil.which("py-spy") is None:
        print("py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 2
    extra = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    args.out.mkdir(parents=True, exist_ok=True)
    common = ("--kv-cache-tokens", "16384", "--max-num-seqs", str(args.streams))
    with Server(args.model, *common, *extra, startup_timeout_s=600) as server:
        # A model directory is served under its own name, as vLLM does.
        served = Path(args.model).name if Path(args.model).is_dir() else args.model
        asyncio.run(_drive(server.url, served, 4, 8))  # warm the HTTP path
        pids = [server.proc.pid, *server.children]
        raws = {pid: args.out / f"{pid}.txt" for pid in pids}
        spies = [subprocess.Popen(["py-spy", "record", "--nonblocking", "--idle", "-t", "-f", "raw", "-r", str(args.rate),
                                   "-d", str(int(args.seconds)), "-o", str(raw), "--pid", str(pid)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for pid, raw in raws.items()]
        started, runs = time.monotonic(), []
        while time.monotonic() - started < args.seconds:
            wall = asyncio.run(_drive(server.url, served, args.streams, args.max_tokens))
            runs.append(args.streams * args.max_tokens / wall)
        for spy in spies:
            spy.wait()
        log = server.output()
    roles = {int(pid): name for name, pid in re.findall(r"(rank \d+(?: \([^)]*\))?) pid (\d+)", log)}
    summary = {"serve_args": extra, "model": args.model, "client_tok_s": runs, "processes": {}}
    for pid, raw in raws.items():
        if not raw.exists():
            continue
        samples, shares = inclusive_shares(raw)
        role = roles.get(pid, "front end" if pid == pids[0] else "helper")
        summary["processes"][str(pid)] = {"samples": samples, "shares": shares[: args.top * 2]}
        if role == "helper":
            continue  # multiprocessing's resource tracker
        print(f"\n== pid {pid} ({role}): {samples} samples of its main thread")
        for name, share in shares[: args.top]:
            print(f"  {share:6.1%}  {name}")
    print(f"\nclient tok/s while sampled: {', '.join(f'{r:.0f}' for r in runs)}")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
