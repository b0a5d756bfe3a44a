"""`ProcessEngineClient`: the front end's handle on the engine rank processes.

It starts the DP ranks (or, under `torchrun`, attaches to the head rank that started it),
assigns each request to the rank with the fewest requests in flight, and turns the head's
output stream into one asyncio queue per request (`RequestStreams`). A pump thread reads the
head's queue and watches the rank processes: a rank that dies (or a head that reports a fatal
error, or says nothing for longer than the step timeout plus `HEARTBEAT_GRACE_S`: the idle
head reports stats four times a second) fails every request in flight with an error and makes
`health()` report it; new requests then get `EngineUnavailableError`, and the ranks still
alive are stopped (the engine does not restart itself: restart the server).
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import sys
import threading
import time
from typing import AsyncIterator, Callable

import torch.multiprocessing as mp

from tandem.models.loader import load_tokenizer_info
from tandem.distributed.launch import find_free_port, threads_per_rank
from tandem.worker.sampling import SamplingParams
from tandem.serving.engine_client import EngineClient, EngineStats, EngineUnavailableError
from tandem.engine.counters import RankCounters
from tandem.engine.outputs import RequestOutput
from tandem.serving.ranks.rank import ServeOptions, local_rank_main
from tandem.serving.ranks.messages import AbortRequest, AddRequest, Fatal, Outputs, Progress, Ready, Shutdown, Stats
from tandem.serving.ranks.request_streams import RequestStreams

#: Silence from the head beyond the step timeout before the front end declares it hung.
HEARTBEAT_GRACE_S = 10.0
#: After a failure, how long the surviving ranks get to report and exit on their own.
FAILURE_GRACE_S = 2.0
#: Attached to a head started by torchrun: how long the front end keeps answering 503 (with
#: the reason) after an engine failure before it exits, so that a supervisor polling
#: /health sees why and torchrun then sees the node fail.
ATTACHED_FAILURE_LINGER_S = 5.0


def _stderr(message: str) -> None:
    print(f"[tandem] {message}", file=sys.stderr, flush=True)


def describe_exit(who: str, exitcode: int) -> str:
    """`who` ended with `exitcode` (a process's: negative for a signal), in words."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"{who} was killed by {name}"
    return f"{who} exited with code {exitcode}"


def spawn_ranks(ctx, topology, config, options: ServeOptions, inbox, outbox, log: Callable[[str], None]) -> list:
    """Start one process per rank of `topology` (`local_rank_main`), rendezvousing on a free
    local port, each with its share of the cores; returns the processes, in rank order."""
    world_size = topology.world_size
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(find_free_port()),
        "OMP_NUM_THREADS": str(threads_per_rank(world_size)),
    }
    procs = []
    for rank in range(world_size):
        proc = ctx.Process(
            target=local_rank_main,
            args=(rank, world_size, env, config, options, inbox, outbox),
            name=f"tandem-rank-{rank}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    log("rank processes: " + ", ".join(f"{topology.describe(r)} pid {p.pid}" for r, p in enumerate(procs)))
    return procs


class ProcessEngineClient(EngineClient):
    def __init__(
        self,
        config,
        options: ServeOptions | None = None,
        *,
        max_queue_len: int | None = None,
        startup_timeout_s: float = 600.0,
        log: Callable[[str], None] = _stderr,
        queues: tuple | None = None,
        world_size: int | None = None,
    ):
        """`queues=(inbox, outbox)` attaches to a head rank started elsewhere (torchrun)
        instead of starting the ranks here."""
        self.config = config
        self.options = options or ServeOptions()
        self.max_queue_len = max_queue_len
        self.startup_timeout_s = startup_timeout_s
        self.log = log
        info = load_tokenizer_info(config.model)
        self.tokenizer = info.tokenizer
        self.eos_token_ids = info.eos_token_ids
        # A request must fit in one rank's KV cache.
        kv_tokens = config.cache.usable_tokens
        wanted = config.scheduler.context_length(info.max_model_len)
        self.max_model_len = min(wanted, kv_tokens)
        if kv_tokens < wanted:
            log(f"context length limited to {kv_tokens} tokens by the KV cache size (asked for {wanted})")
        self.chat_template = info.chat_template
        self.model_name = info.name
        from tandem.distributed import Topology

        par = config.parallel
        self.topology = Topology(par.pipeline_parallel_size, world_size // par.pipeline_parallel_size if world_size else par.data_parallel_size)
        self.world_size = self.topology.world_size
        #: Requests go to the first pipeline stage's ranks (global ranks 0 .. D-1).
        self.num_request_ranks = self.topology.data_parallel_size
        self.num_engines = self.num_request_ranks
        self._attached = queues is not None
        #: Attached front ends are children of the head rank: a new parent means it died.
        self._head_pid = os.getppid() if self._attached else None
        self._ctx = mp.get_context("spawn")
        self._inbox, self._outbox = queues if queues is not None else (self._ctx.Queue(), self._ctx.Queue())
        self._procs: list = []
        self._streams = RequestStreams(self.num_request_ranks)
        self._rank_stats: list[RankCounters | None] = []
        self._last_heard = time.monotonic()
        self._failure: str | None = None
        self._failed_at: float | None = None
        self._reaped = False
        self.heartbeat_timeout_s = self.config.scheduler.step_timeout_s + HEARTBEAT_GRACE_S
        self._stopping = False
        self._draining = False
        self._pump: threading.Thread | None = None
        self.ready = False

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the ranks (unless attached) and block until the head reports ready."""
        if not self._attached:
            self._procs = spawn_ranks(self._ctx, self.topology, self.config, self.options, self._inbox, self._outbox, self.log)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if time.monotonic() > deadline:
                self.kill_ranks()
                raise RuntimeError(f"the engine ranks did not become ready within {self.startup_timeout_s:g} s")
            dead = self._dead_rank()
            try:
                message = self._outbox.get(timeout=0.2)
            except queue.Empty:
                if dead:
                    self.kill_ranks()
                    raise RuntimeError(f"engine start failed: {dead}") from None
                continue
            if isinstance(message, Progress):
                self.log(message.text)
            elif isinstance(message, Fatal):
                self.kill_ranks()
                raise RuntimeError(f"engine start failed: {message.message}")
            elif isinstance(message, Ready):
                break
        self.ready = True
        self._last_heard = time.monotonic()
        self._pump = threading.Thread(target=self._pump_outputs, name="tandem-output-pump", daemon=True)
        self._pump.start()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.stop)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the ranks to stop, wait for them, kill what is left."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self._inbox.put(Shutdown())
        except (OSError, ValueError):
            pass
        if self._failure is not None:
            timeout_s = min(timeout_s, FAILURE_GRACE_S)  # a broken group cannot process "shutdown"
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
        self.kill_ranks()
        self._streams.fail_all("the server is shutting down")

    def begin_drain(self) -> None:
        """Stop taking requests (503, and /health says so); those in flight go on."""
        self._draining = True

    def end_drain(self, message: str) -> None:
        """End every request still in flight with `message` as its error."""
        self._streams.fail_all(message)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def kill_ranks(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)

    def _dead_rank(self) -> str | None:
        if self._attached and os.getppid() != self._head_pid:
            return f"the head rank (pid {self._head_pid}) exited"
        # A rank killed by a signal is a root cause; a rank that exited with an error code
        # may only be reporting a lost peer, so signals are named first.
        exited = [(rank, proc) for rank, proc in enumerate(self._procs) if proc.exitcode is not None]
        exited.sort(key=lambda item: item[1].exitcode >= 0)
        for rank, proc in exited:
            return describe_exit(f"{self.topology.describe(rank)} (pid {proc.pid})", proc.exitcode)
        return None

    # -- output pump ----------------------------------------------------------------------

    def _pump_outputs(self) -> None:
        while not self._stopping:
            try:
                message = self._outbox.get(timeout=0.1)
            except queue.Empty:
                message = None
            except (OSError, EOFError, ValueError):
                message = Fatal("the head rank's output queue closed")
            if message is not None:
                self._last_heard = time.monotonic()
                if isinstance(message, Outputs):
                    for output in message.outputs:
                        self._streams.deliver(output)
                elif isinstance(message, Stats):
                    self._rank_stats = message.per_rank
                elif isinstance(message, Fatal):
                    self._set_failure(self._root_cause(message.message.splitlines()[0]))
            if self._stopping:
                break
            dead = self._dead_rank()
            if dead:
                self._set_failure(dead)
            silent = time.monotonic() - self._last_heard
            if silent > self.heartbeat_timeout_s:
                self._set_failure(
                    f"the head rank has sent nothing for {silent:.0f} s (step timeout "
                    f"{self.config.scheduler.step_timeout_s:g} s): it is hung or unreachable"
                )
            if self._failed_at is not None and not self._reaped and time.monotonic() - self._failed_at > FAILURE_GRACE_S:
                self._reaped = True
                self.kill_ranks()  # the survivors cannot serve without the lost rank
            if self._attached and self._failed_at is not None and time.monotonic() - self._failed_at > ATTACHED_FAILURE_LINGER_S:
                self.log("stopping the front end after the engine failure")
                os.kill(os.getpid(), signal.SIGINT)  # the HTTP server's own graceful stop
                return

    def _root_cause(self, reported: str, grace_s: float = 1.0) -> str:
        """A head that fails because a peer vanished (gloo read error) reports first; give
        the vanished rank's exit a moment to show, and name it rather than the symptom."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            for rank, proc in enumerate(self._procs):
                if rank != 0 and proc.exitcode is not None:
                    return f"{self._dead_rank()} ({reported})"
            time.sleep(0.05)
        return reported

    def _set_failure(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
            self._failed_at = time.monotonic()
            self.log(f"engine failure: {reason}; new requests get 503 until the server is restarted")
            self._streams.fail_all(f"engine failure: {reason}")

    # -- EngineClient ---------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self._failure is not None:
            raise EngineUnavailableError(f"{self._failure} (restart the server)")
        if self._draining:
            raise EngineUnavailableError("the server is shutting down")
        if self._stopping or not self.ready:
            raise EngineUnavailableError("the engine is not running")
        stream, rank = self._streams.open(request_id, self.max_queue_len)
        self._inbox.put(AddRequest(rank, request_id, list(prompt_ids), params))
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        rank = self._streams.close(request_id)
        if rank is not None and not self._stopping:
            self._inbox.put(AbortRequest(rank, request_id))

    def health(self) -> tuple[bool, str]:
        if self._failure is not None:
            return False, self._failure
        if not self.ready:
            return False, "starting"
        if self._stopping or self._draining:
            return False, "shutting down"
        return True, "ok"

    def stats(self) -> EngineStats:
        return EngineStats.of(self.world_size, [s for s in self._rank_stats if s is not None])

    @property
    def in_flight(self) -> list[int]:
        return self._streams.in_flight


__all__ = ["ProcessEngineClient"]
