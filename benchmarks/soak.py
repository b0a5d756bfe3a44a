"""Soak: `tandem serve --data-parallel-size 2 --enable-dbo` (small KV cache, chunked prefill)
under waves of mixed requests for N minutes: streams, hang-ups, aborts, n > 1, long prompts
that chunk and preempt, structured output, logprobs; every third wave adversarial (a new
schema, stop strings or logit-bias map per request, hang-ups mid-grammar; see
`tandem.testing.soak`).

After every wave: every request ended (finished, hung up, aborted, or an HTTP status), the
engine is back to no running or waiting request and no KV in use, and the resident memory and
open file descriptors of every server process are sampled; after the warm-up (measured: the
waves before the memory curve joins the line through the run's second half) neither the whole
server nor any one process may grow by more than `--tolerance` (1 %; the mean of the last
tenth of the waves over the first tenth's). The server is then
stopped with SIGTERM to its whole process group: exit 0 and no process left.

    python benchmarks/soak.py --minutes 10
    python benchmarks/soak.py --minutes 120 --memory-probe

`--memory-probe` has every server process sample its own memory (anonymous vs file-backed,
glibc's in-use vs freed-but-kept, Python's blocks; `tandem.platform.memory_probe`) and the
summary splits each process's growth by them. Prints one line per wave and a table; writes
benchmarks/results/soak.json and a plot of each process's RSS per wave (soak.png). Exits 1
when a request was lost or failed with a 5xx, the engine did not settle, something grew, or
the stop left a process behind.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from tandem.testing.soak import HEADER, SERVE_FLAGS, SoakConfig, as_dict, format_wave, growth, run_wave, server_processes  # noqa: E402
from tandem.testing.soak_report import plot_rss, probe_summary  # noqa: E402
from tandem.testing.server_process import Server  # noqa: E402


def _wave_problems(wave) -> list[str]:
    problems = []
    if wave.outcomes["lost"] or wave.unaccounted:
        problems.append(f"wave {wave.wave}: {wave.outcomes['lost'] + wave.unaccounted} request(s) lost: {wave.problems[:3]}")
    if wave.server_errors:
        problems.append(f"wave {wave.wave}: {wave.server_errors} server error(s): {wave.outcomes}")
    if (wave.running_after, wave.waiting_after, wave.kv_usage_after) != (0, 0, 0):
        problems.append(f"wave {wave.wave}: the engine did not settle (running/waiting/kv "
                        f"{wave.running_after:g}/{wave.waiting_after:g}/{wave.kv_usage_after:g})")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="Waves start until this much time has passed.")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--wave-requests", type=int, default=96)
    parser.add_argument("--adversarial-every", type=int, default=3, help="Every Nth wave is adversarial (0: none).")
    parser.add_argument("--tolerance", type=float, default=0.01, help="Allowed RSS / fd growth after the warm-up.")
    parser.add_argument("--memory-probe", action="store_true", help="Server processes sample their own memory.")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "soak.json")
    args = parser.parse_args()
    # A SIGTERM (a stopped job) unwinds like Ctrl-C, so the server this started is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    config = SoakConfig(clients=args.clients, wave_requests=args.wave_requests, adversarial_every=args.adversarial_every)
    print(f"tandem serve tiny-moe {' '.join(SERVE_FLAGS)}", file=sys.stderr)
    started = time.time()
    env = {"OMP_NUM_THREADS": "1"}
    probe_dir = Path(tempfile.mkdtemp(prefix="tandem-soak-probe-")) if args.memory_probe else None
    if probe_dir is not None:
        env["TANDEM_MEMORY_PROBE"] = str(probe_dir)
    server = Server("tiny-moe", *SERVE_FLAGS, startup_timeout_s=300, env=env)
    waves, problems = [], []
    try:
        print(HEADER, file=sys.stderr, flush=True)
        deadline = time.monotonic() + 60 * args.minutes
        while time.monotonic() < deadline or len(waves) < 3:
            waves.append(run_wave(server.base, config, len(waves), lambda: server_processes(server.proc.pid)))
            print(format_wave(waves[-1]), file=sys.stderr, flush=True)
            problems += _wave_problems(waves[-1])
        code = server.stop(timeout_s=120, sig=signal.SIGTERM, group=True)
        left = server.leftover()
    finally:
        server.kill()
    grown = growth(waves)
    if max(grown.rss, grown.worst_process_rss, grown.fds) > args.tolerance:
        problems.append(f"growth after the warm-up ({grown.warmup} waves): RSS {100 * grown.rss:+.2f} % "
                        f"({grown.worst_process} {100 * grown.worst_process_rss:+.2f} %), open fds {100 * grown.fds:+.1f} %")
    if code != 0 or left:
        problems.append(f"stop (SIGTERM to the group): exit code {code}, left behind {left}")

    print(HEADER)
    for wave in waves:
        print(format_wave(wave))
    print(f"\n{len(waves)} waves ({sum(w.adversarial for w in waves)} adversarial), {sum(w.requests for w in waves)} "
          f"requests in {(time.time() - started) / 60:.1f} min; warm-up {grown.warmup} waves (measured); growth after "
          f"it: RSS {100 * grown.rss:+.2f} % (worst process {grown.worst_process} {100 * grown.worst_process_rss:+.2f} %), "
          f"trend {grown.rss_mb_per_hour:+.2f} MB/h, fds {100 * grown.fds:+.2f} %; stop: exit {code}, {len(left)} left; "
          + ("; ".join(problems) if problems else "all good"))
    probes = probe_summary(probe_dir, waves, grown.warmup) if probe_dir is not None else {}
    for name, split in probes.items():
        print(f"  {name}: " + ", ".join(f"{key} {value:+.2f}" for key, value in split.items() if key != "samples"))

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "command": "python benchmarks/soak.py " + " ".join(sys.argv[1:]),
        "serve_flags": list(SERVE_FLAGS),
        "config": vars(args) | {"json": str(args.json)},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "note": "shared machine: 2 cores, other work running"},
        "started": started,
        "waves": [as_dict(w) for w in waves],
        "warmup_waves": grown.warmup,
        "rss_growth": grown.rss,
        "worst_process": grown.worst_process,
        "worst_process_rss_growth": grown.worst_process_rss,
        "rss_mb_per_hour": grown.rss_mb_per_hour,
        "fd_growth": grown.fds,
        "memory_probe_growth_mb": probes,
        "stop_exit_code": code,
        "left_behind": left,
        "problems": problems,
    }, indent=2) + "\n")
    plot = plot_rss(waves, grown.warmup, args.json.with_suffix(".png"))
    if plot is not None:
        print(f"plot: {plot}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
