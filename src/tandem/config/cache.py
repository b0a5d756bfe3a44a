"""`CacheConfig`: the paged KV cache of one rank."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.options import option


@dataclass
class CacheConfig:
    """The paged KV cache of one rank."""

    #: The blocks themselves; None: `kv_cache_tokens / block_size` plus the null block the
    #: runner reserves for padding rows.
    num_kv_blocks: int | None = None
    block_size: int = option(16, "Tokens per KV cache block.")
    kv_cache_tokens: int = option(32768, "KV cache size per rank, in tokens.")

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"--kv-cache-tokens ({self.kv_cache_tokens}) must hold at least one block of {self.block_size}"
            )
        if self.num_kv_blocks is None:
            self.num_kv_blocks = self.kv_cache_tokens // self.block_size + 1
        elif self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")

    @property
    def usable_tokens(self) -> int:
        """Tokens one rank's cache holds for requests (the runner keeps one block for padding)."""
        return (self.num_kv_blocks - 1) * self.block_size
