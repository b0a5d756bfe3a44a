"""Deciding and splitting: thresholds, slices, attention-metadata slicing, balanced and
two-chunk splits, and DP agreement."""

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
