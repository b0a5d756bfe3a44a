"""What every model family implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn


@dataclass(frozen=True)
class KVCacheSpec:
    """Per attention layer: the cache tensors it needs, each `[num_blocks, block_size, *shape]`.

    Standard attention: `{"key": (Hkv, Dk), "value": (Hkv, Dv)}`; MLA may cache its latent.
    """

    shapes: dict[str, tuple[int, ...]]
    dtype: torch.dtype


class CausalLM(nn.Module, ABC):
    """A decoder-only MoE language model on one expert-parallel rank.

    `forward(input_ids [T], positions [T]) -> hidden [T, H]` reads its attention metadata
    (`AttentionMetadata`) from `tandem.contexts.get_forward_context().attn_metadata`, so
    the same call serves a whole batch or one ubatch. Its attention layers own the cache
    tensors bound by `bind_kv_cache`.
    """

    #: HF `architectures` names this class loads.
    architectures: tuple[str, ...] = ()

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def prepare_weights_after_loading(self) -> None:
        """Called once every weight is in place (by the loader and the built-in builders): each
        MoE layer's experts backend may convert its weights (deep_gemm quantizes them to block
        fp8 and the model-dtype copies are freed), MLA on CUDA joins its two input projections
        into one weight, so no forward converts them later."""
        for module in self.modules():
            prepare = getattr(module, "prepare_loaded_weights", None)
            if callable(prepare):
                prepare()

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per attention layer, in layer order."""

    @abstractmethod
    def bind_kv_cache(self, caches: list[dict[str, torch.Tensor]]) -> None:
        """Give each attention layer its cache tensors (same order as `kv_cache_specs`)."""

    def owns_checkpoint_tensor(self, name: str) -> bool:
        """Whether this model's pipeline stage (`self.stage`, all layers when unset) needs
        checkpoint tensor `name`."""
        stage = getattr(self, "stage", None)
        if stage is None or (stage.is_first and stage.is_last):
            return True  # the whole model: unknown names stay the loader's error
        return stage.owns_checkpoint_tensor(name, tied=getattr(self, "lm_head", None) is None)

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the model; tensors of experts this rank does not hold
        are skipped. Returns the names of the parameters that were loaded."""


@dataclass
class ModelInfo:
    """What the runner needs besides the module: tokenizer and stop tokens."""

    model: CausalLM
    tokenizer: object
    eos_token_ids: set[int] = field(default_factory=set)
    max_model_len: int = 4096
    name: str = ""

    def __post_init__(self) -> None:
        # RoPE kernels index the cos/sin table by position unchecked (a bound check on the
        # device would be a host sync): every position a request may reach must be in it.
        if not isinstance(self.model, nn.Module):
            return
        tables = [m.cos_sin_cache.shape[0] for m in self.model.modules() if isinstance(getattr(m, "cos_sin_cache", None), torch.Tensor)]
        if tables and min(tables) < self.max_model_len:
            raise ValueError(
                f"{self.name or type(self.model).__name__}: a context of {self.max_model_len} tokens reaches past "
                f"the rotary table's {min(tables)} positions"
            )
