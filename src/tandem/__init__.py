"""tandem: micro-batch overlap runtime for Mixture-of-Experts inference."""

from importlib.metadata import PackageNotFoundError, version

from tandem.contexts import (
    ForwardContext,
    GreenletExecutor,
    ThreadExecutor,
    UBatchAborted,
    UBatchContext,
    UBatchTimeoutError,
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
    get_forward_context,
    make_ubatch_contexts,
    run_ubatches,
    set_forward_context,
)
from tandem.ubatch import (
    AttentionSlice,
    BalancedSplit,
    UBatchDecision,
    UBatchSlice,
    balanced_split,
    check_ubatch_thresholds,
    coordinate_ubatching,
    is_last_ubatch_empty,
    slice_attention_metadata,
    split_by_cost,
    split_by_tokens,
)

try:
    __version__ = version("tandem")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+local"

__all__ = [
    "AttentionSlice",
    "BalancedSplit",
    "ForwardContext",
    "GreenletExecutor",
    "ThreadExecutor",
    "UBatchAborted",
    "UBatchContext",
    "UBatchDecision",
    "UBatchSlice",
    "UBatchTimeoutError",
    "balanced_split",
    "check_ubatch_thresholds",
    "coordinate_ubatching",
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
    "is_last_ubatch_empty",
    "make_ubatch_contexts",
    "run_ubatches",
    "set_forward_context",
    "slice_attention_metadata",
    "split_by_cost",
    "split_by_tokens",
]
