"""UBatchContext, the dbo_* functions, executors (threads, greenlets, stages) and the forward context."""

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
