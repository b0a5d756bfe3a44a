"""The engine rank process: one `Engine` per DP rank, all ranks stepping in lockstep.

Rank 0 (the head) is the only one the front end talks to, through two queues. Each loop
iteration the head takes the front end's messages (new requests, each already assigned to
a rank; aborts; shutdown) and broadcasts them to every rank over a gloo control group;
every rank applies its share and runs one engine step (a dummy forward when idle, so the
MoE collectives match); the ranks' output deltas and stats are gathered back to the head,
which forwards them. The control plane is torch.distributed itself, so ranks started by
`torchrun` on other nodes work the same way as local ones.

When no rank has work the head waits for the front end (briefly, so it still reports
stats as a heartbeat) instead of spinning.

Faults. A step whose forward raises (a ubatch fault, a model bug) fails that step's
requests on that rank and the loop goes on; when every rank fails at the same point (a model
bug does) their collectives stay matched. A step that cannot finish (a hung collective, a
dead or hung peer) is bounded by `step_timeout_s`: a watchdog thread ends the rank process
when its loop has made no progress for that long, after telling the front end why (head).
The other ranks' collectives with it then fail (or time out the same way), so every rank
exits and the front end reports the engine unavailable. A slow step under the timeout is
never a fault.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from tandem.platform.heap import HeapTrimmer
from tandem.serving.ranks.messages import (
    AbortRequest, AddRequest, Fatal, FromHead, Outputs, Progress, Ready, Shutdown, Stats, ToHead,
)


@dataclass
class ServeOptions:
    """How a serving process runs (its engine settings are the EngineConfig's `scheduler`)."""

    #: Longest wait of an idle head for the front end before it reports stats again.
    idle_wait_s: float = 0.02
    stats_interval_s: float = 0.25
    warmup: bool = True
    collective_timeout_s: float = 600.0
    gil_switch_interval_s: float = 0.0002


class Watchdog:
    """Calls `on_stuck(stalled_s)` (once) when `beat()` has not been called for `timeout_s`."""

    def __init__(self, timeout_s: float, on_stuck: Callable[[float], None]):
        if timeout_s <= 0:
            raise ValueError(f"the step timeout must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.on_stuck = on_stuck
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stopped.wait(period):
            stalled = time.monotonic() - self._last
            if stalled > self.timeout_s:
                self.on_stuck(stalled)
                return


def _flush(outbox, timeout_s: float = 2.0) -> None:
    """Push what is queued for the front end into the pipe (bounded: the reader may be gone)."""
    if outbox is None:
        return

    def flush() -> None:
        try:
            outbox.close()
            outbox.join_thread()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass

    thread = threading.Thread(target=flush, daemon=True)
    thread.start()
    thread.join(timeout_s)


def hard_exit(code: int, outbox=None) -> None:
    """Leave now: a stuck forward thread would block a normal interpreter exit forever."""
    _flush(outbox)
    sys.stderr.flush()
    os._exit(code)


def _forwarded(inbox):
    """The front end's queue, read by a thread into an in-process one: the loop polls its inbox
    every step, and a multiprocessing queue's poll takes its lock and selects on its pipe
    (~0.2 ms a step on the CPU, 6 % of a one-stream rank) where an in-process queue checks a
    deque. The thread waits in the pipe's read with the GIL released."""
    local = queue.SimpleQueue()

    def pump() -> None:
        while True:
            try:
                message = inbox.get()
            except (EOFError, OSError, ValueError):  # the front end is gone, or the queue closed
                return
            local.put(message)

    threading.Thread(target=pump, name="tandem-inbox", daemon=True).start()
    return local


def _drain(inbox, block_s: float) -> list[ToHead]:
    messages = []
    try:
        messages.append(inbox.get(timeout=block_s) if block_s > 0 else inbox.get_nowait())
        while True:
            messages.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return messages


def _warm_up(engine) -> None:
    """Every rank runs the same tiny request to completion, so lazy initialisation (and
    the first collectives) happen before the first user request."""
    from tandem.worker.sampling import SamplingParams

    engine.add_request("__warmup__", [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while engine.has_work:
        engine.step()


def _exit_when_stuck(rank: int, config, report: Callable[[FromHead], None], outbox) -> Callable[[float], None]:
    """The watchdog's action for a serving rank: say why, tell the front end, leave."""

    def stuck(stalled_s: float) -> None:
        message = (
            f"rank {rank}: no progress for {stalled_s:.0f} s (step timeout {config.scheduler.step_timeout_s:g} s): a step "
            "is stuck (a hung collective, or a dead or hung peer rank)"
        )
        print(f"[tandem] {message}; exiting", file=sys.stderr, flush=True)
        report(Fatal(message))
        hard_exit(3, outbox if rank == 0 else None)

    return stuck


def serve_rank(
    rank: int,
    world_size: int,
    config,
    options: ServeOptions,
    inbox=None,
    outbox=None,
    *,
    frontend_alive: Callable[[], bool] | None = None,
) -> None:
    """Body of one engine rank, after the default process group (if any) is initialised.
    `frontend_alive` (head only): when it turns False, the ranks stop as on "shutdown"."""
    from tandem.engine.build import build_engine
    from tandem.worker.build import write_rank_trace
    from tandem.worker.planner_cache import describe_prior

    def report(message: FromHead) -> None:
        if rank == 0 and outbox is not None:
            outbox.put(message)

    if config.scheduler.overlap_schedule is not False:  # the engine may overlap (`overlaps_schedule`)
        # The scheduler thread and the forward worker share the GIL. With the default 5 ms
        # switch interval, every time the forward drops the GIL around a native op it can
        # wait up to 5 ms to get it back from the scheduler (a convoy); a short interval
        # keeps the forward close to its solo speed.
        sys.setswitchinterval(options.gil_switch_interval_s)
    try:
        report(Progress(f"loading {config.model} on {world_size} rank(s)"))
        engine = build_engine(config, collective_timeout_s=options.collective_timeout_s)
        if not engine.takes_requests:
            _run_later_stage(rank, engine, config)
            return  # its loop ran until the first stage said stop
        runner = engine.runner
        control, world_size = engine.control_plane(world_size)
        if options.warmup:
            report(Progress("warming up"))
            _warm_up(engine)
        notes = (engine.startup_note(config.scheduler.max_num_seqs), describe_prior(runner.planner, config.overlap))
        for note in notes:
            if note is not None:
                report(Progress(note))
        info = runner.info
        report(Ready(info.name, info.max_model_len, world_size))

        watchdog = Watchdog(config.scheduler.step_timeout_s, _exit_when_stuck(rank, config, report, outbox)).start()
        try:
            inbox = _forwarded(inbox) if inbox is not None else None
            _loop(rank, world_size, engine, options, control, inbox, outbox, frontend_alive, watchdog)
            watchdog.beat()
            engine.close()
            write_rank_trace(runner, config.trace_path, group=engine.trace_group(control))
        finally:
            watchdog.stop()
    except BaseException as exc:  # noqa: BLE001 - tell the front end before dying
        report(Fatal(f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


def _run_later_stage(rank: int, stage, config) -> None:
    """A pipeline stage after the first: run its loop to its end under the watchdog, then
    join the trace gather of every rank."""
    from tandem.worker.build import write_rank_trace

    where = stage.groups.topology.describe(rank)

    def stuck(stalled_s: float) -> None:
        print(f"[tandem] {where}: no micro-batch or heartbeat for {stalled_s:.0f} s (step timeout "
              f"{config.scheduler.step_timeout_s:g} s): the pipeline is stuck; exiting", file=sys.stderr, flush=True)
        hard_exit(3)

    watchdog = Watchdog(config.scheduler.step_timeout_s, stuck).start()
    try:
        stage.run(on_message=watchdog.beat)
        watchdog.beat()
        write_rank_trace(stage.runner, config.trace_path, group=stage.trace_group(None))
    finally:
        watchdog.stop()


def _take_messages(rank: int, engine, messages: list[ToHead]) -> tuple[list, bool]:
    """Apply this rank's share of the front end's messages: (immediate outputs, stop?)."""
    outputs, stop = [], False
    for message in messages:
        if isinstance(message, AddRequest):
            if message.rank == rank:
                rejected = engine.add_request(message.request_id, message.prompt_ids, message.params)
                if rejected is not None:
                    outputs.append(rejected)
        elif isinstance(message, AbortRequest):
            if message.rank == rank:
                aborted = engine.abort(message.request_id)
                if aborted is not None:
                    outputs.append(aborted)
        elif isinstance(message, Shutdown):
            stop = True
        else:
            raise TypeError(f"rank {rank}: unknown control message {message!r}")
    return outputs, stop


def _step(rank: int, engine, outbox, pending: list) -> list:
    """One engine step; its outputs. When the step failed, rank 0 answers its failed requests
    (and `pending`, emptied) at once: if the failure left the other ranks stuck, the gather
    after the step waits for the step timeout."""
    failed_before = engine.failed_steps
    outputs = engine.step()
    if engine.failed_steps != failed_before:
        # The error names no request content; the requests got it as their error.
        print(f"[tandem] rank {rank}: {engine.last_failure}; its requests failed, serving goes on",
              file=sys.stderr, flush=True)
        if rank == 0 and outbox is not None and (pending or outputs):
            outbox.put(Outputs(pending + outputs))
            pending.clear()
            return []
    return outputs


def _loop(rank, world_size, engine, options: ServeOptions, control, inbox, outbox, frontend_alive=None,
          watchdog: Watchdog | None = None) -> None:
    busy_anywhere = False
    last_stats = 0.0
    heap = HeapTrimmer()
    while True:
        if watchdog is not None:
            watchdog.beat()
        messages: list[ToHead] = []
        run_step = False
        now = time.monotonic()
        due = now - last_stats >= options.stats_interval_s  # the head's clock decides for all
        if rank == 0:
            idle = not busy_anywhere and not engine.has_work
            messages = _drain(inbox, options.idle_wait_s if idle else 0.0)
            if due and frontend_alive is not None and not frontend_alive():
                messages.append(Shutdown())
            # One decision for all ranks: step while any rank has work or a request arrives.
            run_step = busy_anywhere or engine.has_work or any(isinstance(m, AddRequest) for m in messages)
        if control is not None:
            box = [(messages, run_step, due)]
            dist.broadcast_object_list(box, src=0, group=control)
            messages, run_step, due = box[0]
        outputs, stop = _take_messages(rank, engine, messages)
        if stop:
            return
        stepping = run_step if control is not None else engine.has_work
        if not stepping:
            engine.idle()
            heap.idle()
        if stepping:
            outputs += _step(rank, engine, outbox, outputs)
        stats = engine.stats() if due else None
        per_rank: list = []
        if control is not None:
            gathered = [None] * world_size if rank == 0 else None
            dist.gather_object((outputs, stats, engine.has_work), gathered, dst=0, group=control)
            if rank == 0:
                outputs = [out for rank_outputs, _, _ in gathered for out in rank_outputs]
                busy_anywhere = any(has_work for _, _, has_work in gathered)
                per_rank = [rank_stats for _, rank_stats, _ in gathered]
        else:
            busy_anywhere = engine.has_work
            per_rank = [stats]
        if rank == 0 and outbox is not None:
            if outputs:
                outbox.put(Outputs(outputs))
            if due:
                outbox.put(Stats(per_rank))
        if due:
            last_stats = now


def local_rank_main(rank: int, world_size: int, env: dict, config, options: ServeOptions, inbox, outbox) -> None:
    """Entry point of a rank process started by the local front end."""
    import multiprocessing

    from tandem.platform.memory_probe import start_from_env
    from tandem.serving.ranks.lifetime import die_with_parent, ignore_stop_signals

    start_from_env(f"rank{rank}")
    parent = multiprocessing.parent_process()
    die_with_parent(parent.pid if parent is not None else None)
    # A stop signal to the whole group: the front end drains, then shuts the ranks down in order.
    ignore_stop_signals()
    from tandem.distributed.launch import use_thread_env

    use_thread_env(env)
    try:
        if world_size > 1:
            from tandem.distributed.launch import init_rank

            init_rank(rank, world_size, device=config.device, timeout_s=options.collective_timeout_s)
        serve_rank(rank, world_size, config, options, inbox if rank == 0 else None, outbox if rank == 0 else None)
    except BaseException:  # noqa: BLE001 - reported to the front end by serve_rank (head)
        traceback.print_exc()
        # A forward thread stuck in a collective would keep a normal exit waiting forever.
        hard_exit(1, outbox if rank == 0 else None)
    if world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["ServeOptions", "Watchdog", "hard_exit", "local_rank_main", "serve_rank"]
