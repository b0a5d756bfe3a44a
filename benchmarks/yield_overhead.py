"""Cost of one `dbo_yield` handover per executor, with the time model on, next to the raw
floor measured in the same run (a bare two-lock thread handoff for `thread`, a bare
greenlet switch for `greenlet`) and to vLLM's own ubatch ring as a peer.

    python benchmarks/yield_overhead.py [--switches 20000] [--runs 7] [--json PATH]
                                        [--vllm-wheel WHEEL | --no-vllm]

The peer is vLLM's `vllm/v1/worker/ubatching.py`, read at run time out of a wheel that
`pip download vllm` puts in a temporary directory (or `--vllm-wheel`), with stand-ins for
its few vLLM imports and a constant current stream (no CUDA needed); nothing of it is
kept. Without a wheel the peer is skipped with the reason printed.

Every case runs `--runs` times, interleaved so all see the same machine state; the table
shows medians, and each ratio compares two medians of this one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
import zipfile
from pathlib import Path
from typing import Callable
from unittest import mock

import greenlet

from tandem import dbo_yield, run_ubatches
from tandem.contexts import CommCounters, make_executor, time_model

#: Goals from issue 14: greenlet at most 1 µs and 2x a bare switch, thread at most 1.5x
#: the two-lock floor.
GREENLET_MAX_US = 1.0
GREENLET_MAX_RATIO = 2.0
THREAD_MAX_RATIO = 1.5

_VLLM_SOURCE = "vllm/v1/worker/ubatching.py"
_JOIN_TIMEOUT_S = 120.0


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

    _run_threads([threading.Thread(target=second), threading.Thread(target=first)])
    return timing[0] / (2 * rounds)


class _Clocks:
    """Wall time, and the calling thread's CPU time: for work that stays on one thread
    (greenlets) the two agree on an idle machine, and the CPU time leaves out the time
    other processes held the core, so it stays readable on a shared machine."""

    def __enter__(self) -> "_Clocks":
        self._wall, self._cpu = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s, self.cpu_s = time.perf_counter() - self._wall, time.thread_time() - self._cpu


def bare_greenlet_switch(switches: int, *, in_call: bool = False) -> tuple[float, float]:
    """Seconds per switch of two greenlets ping-ponging: wall and CPU time. `in_call`
    makes each switch inside a called function, as any yield API must (greenlet then
    materialises a frame object for that fresh frame)."""
    rounds = switches // 2
    main = greenlet.getcurrent()

    def partner() -> None:
        for _ in range(rounds):
            main.switch()

    other = greenlet.greenlet(partner)

    def call() -> None:
        other.switch()

    with _Clocks() as clocks:
        if in_call:
            for _ in range(rounds):
                call()
        else:
            for _ in range(rounds):
                other.switch()
    other.switch()  # let it finish
    return clocks.wall_s / (2 * rounds), clocks.cpu_s / (2 * rounds)


def dbo_yield_switch(executor, switches: int) -> tuple[float, float]:
    """Seconds per `dbo_yield` handover with two ubatches (each yields switches/2 times),
    inside `time_model` as a runner's forward is: wall time and the caller thread's CPU
    time (meaningful for greenlets only, which run on the caller's thread)."""
    per_ubatch = switches // 2

    def ubatch() -> None:
        for _ in range(per_ubatch):
            dbo_yield()

    with time_model(CommCounters()), _Clocks() as clocks:
        run_ubatches([ubatch, ubatch], executor=executor)
    return clocks.wall_s / (2 * per_ubatch), clocks.cpu_s / (2 * per_ubatch)


def _run_threads(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(_JOIN_TIMEOUT_S)
        if t.is_alive():
            raise TimeoutError(f"benchmark thread {t.name} did not finish in {_JOIN_TIMEOUT_S:g} s")


# -- vLLM's ring as a peer ------------------------------------------------------------------


def _download_vllm_wheel(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "vllm", "--no-deps", "--only-binary", ":all:", "-q", "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wheels = sorted(into.glob("vllm-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise RuntimeError(f"`pip download vllm` failed: {tail[0]}")
    return wheels[0]


def _load_vllm_ubatching(wheel: Path) -> types.ModuleType:
    """Execute vLLM's ubatching module from `wheel` with stand-ins for its vLLM imports.

    It needs `vllm.forward_context` (a module global it swaps per ubatch), a logger and
    `current_stream()`; the stand-in stream is a constant, so its yields never call
    `torch.cuda.set_stream` (on CUDA that call would add to vLLM's figure, not ours).
    """
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(_VLLM_SOURCE).decode()
    forward_context = types.ModuleType("vllm.forward_context")
    forward_context.ForwardContext = type("ForwardContext", (), {})
    forward_context._forward_context = None
    stream = object()
    package = types.ModuleType("vllm")
    package.forward_context = forward_context
    stand_ins = {
        "vllm": package,
        "vllm.forward_context": forward_context,
        "vllm.logger": types.SimpleNamespace(init_logger=logging.getLogger),
        "vllm.utils": types.ModuleType("vllm.utils"),
        "vllm.utils.torch_utils": types.SimpleNamespace(current_stream=lambda: stream),
    }
    module = types.ModuleType("vllm_peer_ubatching")
    module.__file__ = f"{wheel.name}/{_VLLM_SOURCE}"
    with mock.patch.dict(sys.modules, stand_ins):
        exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102 - the peer under test
    module.STAND_IN_STREAM = stream
    return module


def load_vllm_peer(wheel: Path | None) -> tuple[types.ModuleType | None, str]:
    """vLLM's ubatching module and its wheel's name, or None and why not."""
    try:
        if wheel is not None:
            return _load_vllm_ubatching(wheel), wheel.name
        with tempfile.TemporaryDirectory(prefix="tandem-vllm-peer-") as tmp:
            wheel = _download_vllm_wheel(Path(tmp))
            return _load_vllm_ubatching(wheel), wheel.name
    except Exception as exc:  # noqa: BLE001 - any failure only skips the peer
        return None, f"{type(exc).__name__}: {exc}"


def vllm_ring_switch(ubatching: types.ModuleType, switches: int) -> float:
    """Seconds per `dbo_yield` handover in vLLM's ring, driven as its GPU ubatch wrapper
    drives it: a fresh thread per ubatch, a ready barrier, then ubatch 0 is signalled."""
    per_ubatch = switches // 2
    barrier = threading.Barrier(3, timeout=_JOIN_TIMEOUT_S)
    stream = ubatching.STAND_IN_STREAM
    contexts = ubatching.make_ubatch_contexts(
        2,
        compute_stream=stream,
        comm_stream=stream,
        forward_contexts=[ubatching.ForwardContext(), ubatching.ForwardContext()],
        ready_barrier=barrier,
    )

    def ubatch(ctx) -> None:
        with ctx:
            for _ in range(per_ubatch):
                ubatching.dbo_yield()

    start = time.perf_counter()
    threads = [threading.Thread(target=ubatch, args=(ctx,)) for ctx in contexts]
    for t in threads:
        t.start()
    barrier.wait()
    contexts[0].cpu_wait_event.set()
    for t in threads:
        t.join(_JOIN_TIMEOUT_S)
        if t.is_alive():
            raise TimeoutError("vLLM's ring did not finish")
    return (time.perf_counter() - start) / (2 * per_ubatch)


# -- the run ---------------------------------------------------------------------------------


def _medians_us(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) * 1e6 for name, values in samples.items()}


def measure(switches: int, runs: int, vllm: types.ModuleType | None) -> dict[str, list[float]]:
    """Seconds per switch of every case, `runs` samples each; `*_cpu` are the greenlet
    cases' CPU times."""
    thread_executor, greenlet_executor = make_executor("thread"), make_executor("greenlet")
    cases: dict[str, Callable[[], float | tuple[float, float]]] = {
        "thread_floor": lambda: bare_thread_handoff(switches),
        "thread": lambda: dbo_yield_switch(thread_executor, switches)[0],
        "greenlet_floor": lambda: bare_greenlet_switch(switches),
        "greenlet": lambda: dbo_yield_switch(greenlet_executor, switches),
        "greenlet_called": lambda: bare_greenlet_switch(switches, in_call=True),
    }
    if vllm is not None:
        cases["vllm_ring"] = lambda: vllm_ring_switch(vllm, switches)
    for case in cases.values():  # warm-up: worker threads, first-call paths
        case()
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        for name, case in cases.items():
            result = case()
            if isinstance(result, tuple):
                samples.setdefault(f"{name}_cpu", []).append(result[1])
                result = result[0]
            samples.setdefault(name, []).append(result)
    thread_executor.close()
    return samples


def build_rows(samples: dict[str, list[float]]) -> list[dict]:
    us = _medians_us(samples)

    def row(case: str, name: str, floor: str, floor_name: str, goal: str, met: bool | None) -> dict:
        values = samples[name]
        entry = {
            "case": case,
            "dbo_yield_us": round(us[name], 3),
            "spread_us": [round(min(values) * 1e6, 3), round(max(values) * 1e6, 3)],
            "floor": floor_name,
            "floor_us": round(us[floor], 3),
            "ratio": round(us[name] / us[floor], 3),
            "goal": goal,
            "met": met,
        }
        if f"{name}_cpu" in us:
            entry["cpu_us"] = round(us[f"{name}_cpu"], 3)
            entry["cpu_floor_us"] = round(us[f"{floor}_cpu"], 3)
            entry["cpu_ratio"] = round(us[f"{name}_cpu"] / us[f"{floor}_cpu"], 3)
        return entry

    thread_ok = us["thread"] / us["thread_floor"] <= THREAD_MAX_RATIO
    greenlet_us_ok = us["greenlet"] <= GREENLET_MAX_US
    greenlet_ratio_ok = us["greenlet"] / us["greenlet_floor"] <= GREENLET_MAX_RATIO
    rows = [
        row("tandem thread", "thread", "thread_floor", "two-lock thread handoff", f"<= {THREAD_MAX_RATIO}x floor", thread_ok),
        row(
            "tandem greenlet", "greenlet", "greenlet_floor", "bare greenlet switch",
            f"<= {GREENLET_MAX_US:g} us and <= {GREENLET_MAX_RATIO}x floor", greenlet_us_ok and greenlet_ratio_ok,
        ) | {"met_us": greenlet_us_ok, "met_ratio": greenlet_ratio_ok},
        row("greenlet switch in a call", "greenlet_called", "greenlet_floor", "bare greenlet switch", "reference", None),
    ]
    if "vllm_ring" in us:
        rows.append(row("vLLM ring (threads, Events)", "vllm_ring", "thread_floor", "two-lock thread handoff", "peer", None))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<29}{'dbo_yield µs':>13}{'floor µs':>10}{'ratio':>7}{'cpu µs':>8}{'cpu ratio':>10}  {'goal':<28}{'met':<5}floor")
    for r in rows:
        met = "-" if r["met"] is None else ("yes" if r["met"] else "no")
        cpu = f"{r['cpu_us']:>8.2f}{r['cpu_ratio']:>10.2f}" if "cpu_us" in r else f"{'-':>8}{'-':>10}"
        print(
            f"{r['case']:<29}{r['dbo_yield_us']:>13.2f}{r['floor_us']:>10.2f}{r['ratio']:>7.2f}{cpu}  "
            f"{r['goal']:<28}{met:<5}{r['floor']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--switches", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "yield_overhead.json")
    peer = parser.add_mutually_exclusive_group()
    peer.add_argument("--vllm-wheel", type=Path, help="read vLLM's ring from this wheel instead of downloading one")
    peer.add_argument("--no-vllm", action="store_true", help="skip vLLM's ring")
    args = parser.parse_args()
    if args.switches < 2 or args.runs < 1:
        parser.error("--switches must be >= 2 and --runs >= 1")

    if args.no_vllm:
        vllm, vllm_source = None, "skipped: --no-vllm"
    else:
        vllm, vllm_source = load_vllm_peer(args.vllm_wheel)
        if vllm is None:
            print(f"vLLM peer skipped: {vllm_source}")
            vllm_source = f"skipped: {vllm_source}"

    load_before = os.getloadavg()
    samples = measure(args.switches, args.runs, vllm)
    rows = build_rows(samples)
    print_table(rows)
    print(
        f"medians of {args.runs} runs x {args.switches} switches, ratios within this run; "
        f"cpu: the greenlet cases' thread CPU time; load average {load_before[0]:.1f} at start"
    )

    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "rows": rows,
        "samples_us": {name: [round(v * 1e6, 3) for v in values] for name, values in samples.items()},
        "config": {
            "switches": args.switches,
            "runs": args.runs,
            "time_model": True,
            "vllm_peer": vllm_source,
            "python": platform.python_version(),
            "greenlet": greenlet.__version__,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_at_start": [round(x, 2) for x in load_before],
        },
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
