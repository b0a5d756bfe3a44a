"""MoE transformer families (DeepSeek-V2/V3, Qwen2-MoE, Qwen3-MoE, Mixtral), the built-in
tiny-moe preset and loading from Hugging Face model directories."""

from tandem.models.base import CausalLM, KVCacheSpec, ModelInfo
from tandem.models.paged_attention import AttentionMetadata, paged_attention, read_from_cache, write_to_cache

__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "KVCacheSpec",
    "ModelInfo",
    "paged_attention",
    "read_from_cache",
    "write_to_cache",
]
