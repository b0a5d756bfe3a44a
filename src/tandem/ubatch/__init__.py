"""Where a step is cut, and whether it is: pure decisions over token counts, no execution.

What it holds: the thresholds (`thresholds.py`), the token-axis slices (`slices.py`:
`UBatchSlice`, `split_by_tokens`), cost-aware cuts (`cost_split.py`), TBO's balanced and
two-chunk splits (`balanced.py`), the per-ubatch attention metadata (`attention.py`), the DP
ranks' agreement on ubatching and padding (`coordination.py`, one all-reduce), the overlap
planner (`planner.py`) and its cost model (`cost_model.py`).

What it never does: run a ubatch, switch threads, touch streams, or read a model. How the
ubatches it cuts are run is `tandem.contexts`; the step that asks is `tandem.worker`
(`ModelRunner.plan_step`)."""

from tandem.ubatch.attention import AttentionSlice, slice_attention_metadata
from tandem.ubatch.balanced import BalancedSplit, balanced_split
from tandem.ubatch.cost_split import attention_work, split_by_cost
from tandem.ubatch.coordination import UBatchDecision, coordinate_ubatching
from tandem.ubatch.slices import UBatchSlice, is_last_ubatch_empty, slices_at_cuts, split_by_tokens
from tandem.ubatch.thresholds import check_ubatch_thresholds

__all__ = [
    "AttentionSlice",
    "BalancedSplit",
    "UBatchDecision",
    "UBatchSlice",
    "attention_work",
    "balanced_split",
    "check_ubatch_thresholds",
    "coordinate_ubatching",
    "is_last_ubatch_empty",
    "slice_attention_metadata",
    "slices_at_cuts",
    "split_by_cost",
    "split_by_tokens",
]
