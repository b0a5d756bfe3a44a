"""How ubatches run, once a step is cut: the executors, the hand-over, and what code inside a
ubatch sees.

What it holds: the executors (`executors.py`: threads and greenlets, which run zero-argument
ubatch functions and switch at `dbo_yield`; `operations.py`: TBO's operation lists and the
stage executor, which interleaves them on the caller's thread), the turn passed among the
ubatches of one run (`turns.py`), each ubatch's `UBatchContext` (`ubatch_context.py`: streams,
events, receive hooks), the `dbo_*` functions model and kernel code call (`dbo.py`), the
per-step forward context (`forward_context.py`), the time model (`time_model.py`) and the
overlap timeline (`trace.py`).

What it never does: decide where or whether a step is cut (that is `tandem.ubatch`), or know
a model, a kernel or an engine. Callers branch on an executor's `runs_operations`, never on
its class."""

from tandem.contexts.dbo import (
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)
from tandem.contexts.errors import UBatchAborted, UBatchTimeoutError
from tandem.contexts.executors import (
    GreenletExecutor,
    ThreadExecutor,
    UBatchExecutor,
    make_executor,
    run_ubatches,
)
from tandem.contexts.operations import (
    ExecutionOperation,
    OperationsStrategy,
    StageExecutor,
    YieldOperation,
    execute_operations,
    execute_overlapped_operations,
)
from tandem.contexts.time_model import (
    CommCounters,
    StepTimes,
    current_comm_counters,
    measure_step,
    time_model,
    timed_blocking,
    timed_receive,
)
from tandem.contexts.forward_context import ForwardContext, get_forward_context, set_forward_context
from tandem.contexts.ubatch_context import (
    DEFAULT_TIMEOUT_S,
    UBatchContext,
    current_ubatch_context,
    make_ubatch_contexts,
)

__all__ = [
    "CommCounters",
    "StepTimes",
    "current_comm_counters",
    "measure_step",
    "time_model",
    "timed_blocking",
    "timed_receive",
    "DEFAULT_TIMEOUT_S",
    "ExecutionOperation",
    "OperationsStrategy",
    "StageExecutor",
    "YieldOperation",
    "execute_operations",
    "execute_overlapped_operations",
    "ForwardContext",
    "GreenletExecutor",
    "ThreadExecutor",
    "UBatchAborted",
    "UBatchContext",
    "UBatchExecutor",
    "UBatchTimeoutError",
    "current_ubatch_context",
    "dbo_current_ubatch_id",
    "dbo_enabled",
    "dbo_maybe_run_recv_hook",
    "dbo_register_recv_hook",
    "dbo_switch_to_comm",
    "dbo_switch_to_comm_sync",
    "dbo_switch_to_compute",
    "dbo_switch_to_compute_sync",
    "dbo_yield",
    "dbo_yield_and_switch_from_comm_to_compute",
    "dbo_yield_and_switch_from_compute_to_comm",
    "get_forward_context",
    "make_executor",
    "make_ubatch_contexts",
    "run_ubatches",
    "set_forward_context",
]
