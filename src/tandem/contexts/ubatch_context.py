"""`UBatchContext`: one ubatch's share of a run (its turn, streams, events, receive hooks
and forward context), and `make_ubatch_contexts` to build the set for one run."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable, Sequence

from tandem.contexts.errors import UBatchAborted
from tandem.contexts.forward_context import _FORWARD_CONTEXT
from tandem.contexts.turns import GreenletHandoff, Handoff, ThreadHandoff
from tandem.platform import Platform, get_platform

DEFAULT_TIMEOUT_S = 60.0

_CURRENT_UBATCH: ContextVar["UBatchContext | None"] = ContextVar("tandem_current_ubatch", default=None)


def current_ubatch_context() -> "UBatchContext | None":
    return _CURRENT_UBATCH.get()


#: The ubatch whose stage `execute_overlapped_operations` is running (None elsewhere). The
#: stage executor has no `UBatchContext`; `dbo_current_ubatch_id` reads this instead, so
#: per-ubatch buffers (DeepEP's) are picked the same way under every executor.
_CURRENT_STAGE_UBATCH: ContextVar[int | None] = ContextVar("tandem_current_stage_ubatch", default=None)


def current_stage_ubatch() -> int | None:
    return _CURRENT_STAGE_UBATCH.get()


class UBatchContext:
    """Entered (`with ctx:`) by the thread or greenlet that runs ubatch `id`.

    Streams follow vLLM's protocol: all ubatches share one compute and one comm stream;
    each ubatch has a comm-done and a compute-done event, recorded on one stream and
    waited on by the other when the ubatch moves its work between them.
    """

    def __init__(
        self,
        ubatch_id: int,
        handoff: Handoff,
        platform: Platform,
        compute_stream: Any,
        comm_stream: Any,
        forward_context: Any = None,
    ):
        self.id = ubatch_id
        self.num_ubatches = handoff.num_ubatches
        self._handoff = handoff
        self._platform = platform
        self._pass_turn = handoff.turns[ubatch_id].pass_
        #: `yield_()`: hand the CPU to the next ubatch; returns when this one has the turn
        #: again. Set per context so a yield is one call to the turn: the stream needs
        #: putting back only where greenlets share one thread's current stream.
        if handoff.shares_thread and platform.stream_is_thread_state:
            self.yield_ = self._yield_and_restore_stream
        else:
            self.yield_ = self._pass_turn
        self.compute_stream = compute_stream
        self.comm_stream = comm_stream
        self.current_stream = compute_stream
        self.gpu_comm_done_event = platform.new_event()
        self.gpu_compute_done_event = platform.new_event()
        self.forward_context = forward_context
        self.recv_hooks: list[Callable[[], Any]] = []
        self.siblings: Sequence[UBatchContext] = (self,)
        self._tokens: tuple | None = None

    def __repr__(self) -> str:
        return f"UBatchContext(id={self.id}, num_ubatches={self.num_ubatches})"

    # -- entering and leaving ------------------------------------------------------------

    def __enter__(self) -> "UBatchContext":
        if self._tokens is not None:
            raise RuntimeError(f"{self!r} is already entered; a context serves one ubatch of one run")
        # Without its own forward context a ubatch sees the caller's.
        forward_token = None if self.forward_context is None else _FORWARD_CONTEXT.set(self.forward_context)
        self._tokens = (_CURRENT_UBATCH.set(self), forward_token)
        try:
            self._handoff.wait_turn(self.id)
            self._platform.set_stream(self.current_stream)
        except BaseException as exc:
            self._leave(exc)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            try:
                self._run_recv_hooks()
            except BaseException as hook_exc:
                self._leave(hook_exc)
                raise
        self._leave(exc)
        return False

    def _leave(self, exc: BaseException | None) -> None:
        if exc is not None and not isinstance(exc, UBatchAborted):
            self._handoff.record_failure(self.id, exc)
        try:
            self._handoff.finish(self.id)
        finally:
            current, forward = self._tokens
            self._tokens = None
            if forward is not None:
                _FORWARD_CONTEXT.reset(forward)
            _CURRENT_UBATCH.reset(current)

    # -- CPU handover --------------------------------------------------------------------

    def _yield_and_restore_stream(self) -> None:
        self._pass_turn()
        self._platform.set_stream(self.current_stream)

    def register_recv_hook(self, hook: Callable[[], Any]) -> None:
        """Park `hook` on the next unfinished ubatch (or on this one if it is the last)."""
        target = self._handoff.next_alive(self.id)
        self.siblings[self.id if target is None else target].recv_hooks.append(hook)

    def maybe_run_recv_hook(self) -> None:
        self._run_recv_hooks()

    def _run_recv_hooks(self) -> None:
        while self.recv_hooks:
            self.recv_hooks.pop(0)()

    # -- streams and events --------------------------------------------------------------

    def _set_stream(self, stream: Any) -> None:
        self.current_stream = stream
        self._platform.set_stream(stream)

    def _signal_comm_done(self) -> None:
        self.gpu_comm_done_event.record(self.comm_stream)

    def _signal_compute_done(self) -> None:
        self.gpu_compute_done_event.record(self.compute_stream)

    def _wait_comm_done(self) -> None:
        self.gpu_comm_done_event.wait(self.compute_stream)

    def _wait_compute_done(self) -> None:
        self.gpu_compute_done_event.wait(self.comm_stream)

    def switch_to_comm(self) -> None:
        self._set_stream(self.comm_stream)

    def switch_to_compute(self) -> None:
        self._set_stream(self.compute_stream)

    def switch_to_comm_sync(self) -> None:
        self._signal_compute_done()
        self._set_stream(self.comm_stream)
        self._wait_compute_done()

    def switch_to_compute_sync(self) -> None:
        self._signal_comm_done()
        self._set_stream(self.compute_stream)
        self._wait_comm_done()

    def yield_and_switch_from_compute_to_comm(self) -> None:
        self._signal_compute_done()
        self.yield_()
        self._set_stream(self.comm_stream)
        self._wait_compute_done()

    def yield_and_switch_from_comm_to_compute(self) -> None:
        self._signal_comm_done()
        self.yield_()
        self._set_stream(self.compute_stream)
        self._wait_comm_done()


_HANDOFFS = {"thread": ThreadHandoff, "greenlet": GreenletHandoff}


def make_ubatch_contexts(
    num_ubatches: int,
    *,
    executor: str = "thread",
    compute_stream: Any = None,
    comm_stream: Any = None,
    forward_contexts: Sequence[Any] | None = None,
    platform: Platform | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[UBatchContext]:
    """Contexts for one run of `num_ubatches` ubatches; ubatch 0 holds the first turn.

    With `executor="thread"`, each context may be entered from any thread (`with ctx:`);
    `"greenlet"` contexts run only under a `GreenletExecutor`. Every internal wait gives up
    after `timeout` seconds without a handover and raises `UBatchTimeoutError`.
    """
    kind = getattr(executor, "kind", executor)
    if kind not in _HANDOFFS:
        raise ValueError(f"unknown ubatch executor {kind!r}: expected one of {sorted(_HANDOFFS)}")
    if forward_contexts is not None and len(forward_contexts) != num_ubatches:
        raise ValueError(f"got {len(forward_contexts)} forward contexts for {num_ubatches} ubatches")
    platform = platform or get_platform()
    compute_stream = compute_stream if compute_stream is not None else platform.current_stream()
    comm_stream = comm_stream if comm_stream is not None else platform.new_stream()
    handoff = _HANDOFFS[kind](num_ubatches, timeout)
    contexts = [
        UBatchContext(
            i,
            handoff,
            platform,
            compute_stream,
            comm_stream,
            forward_contexts[i] if forward_contexts is not None else None,
        )
        for i in range(num_ubatches)
    ]
    for ctx in contexts:
        ctx.siblings = contexts
    return contexts
