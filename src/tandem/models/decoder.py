"""The decoder skeleton Qwen2-MoE, Qwen3-MoE and Mixtral share (embed → [norm, attention,
norm, MLP or MoE] × L → norm → lm_head), and loading HF-named tensors into it."""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

from tandem.distributed.partition import MissingLayer, StageLayers, build_layers
from tandem.models.base import CausalLM, KVCacheSpec, MoEOptions
from tandem.models.hf_config import as_config, check_silu, config_value, rope_theta
from tandem.models.layer_operations import DecoderLayerOperations, OperationsModel
from tandem.models.layers import Attention, RMSNorm, StackedExperts

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)(\.weight)?$")
#: Checkpoint tensors no model here needs (old HF checkpoints saved RoPE buffers).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class DecoderLayer(DecoderLayerOperations, nn.Module):
    def __init__(self, self_attn: Attention, mlp: nn.Module, hidden_size: int, eps: float, dtype: torch.dtype, mlp_name: str):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)

    @property
    def feed_forward(self) -> nn.Module:
        return getattr(self, self.mlp_name)

    def attention_core(self, prepared: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.self_attn.core(prepared)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.feed_forward(self.post_attention_layernorm(hidden))


class DecoderBackbone(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, layers: nn.ModuleList, eps: float, dtype: torch.dtype,
        stage: StageLayers, tied: bool,
    ):
        super().__init__()
        owns_embedding = stage.owns_embedding(tied)
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, dtype=dtype) if owns_embedding else MissingLayer()
        self.layers = layers
        self.norm = RMSNorm(hidden_size, eps, dtype) if stage.is_last else MissingLayer()


class MoEDecoderForCausalLM(OperationsModel, CausalLM):
    """Parameters carry the HF checkpoint names (`model.layers.{i}.self_attn.q_proj.weight`,
    ...), except the routed experts, stacked as `...experts.w13` / `...experts.w2`.
    Subclasses build one layer's attention and MLP, and may rename checkpoint names."""

    #: attribute name of the MLP / MoE block in a decoder layer (Mixtral: block_sparse_moe).
    mlp_name = "mlp"

    def __init__(
        self, config: Any, moe: MoEOptions | None = None, dtype: torch.dtype = torch.float32, stage: StageLayers | None = None
    ):
        super().__init__()
        self.config = config = as_config(config)
        self.moe = moe or MoEOptions()
        self.dtype = dtype
        check_silu(config)
        hidden = config_value(config, "hidden_size")
        eps = config_value(config, "rms_norm_eps", default=1e-6)
        num_layers = config_value(config, "num_hidden_layers")
        self.stage = stage or StageLayers.whole(num_layers)
        layers = build_layers(
            num_layers,
            lambda i: DecoderLayer(self.build_attention(i), self.build_mlp(i), hidden, eps, dtype, self.mlp_name),
            self.stage,
        )
        self.tie_word_embeddings = bool(config_value(config, "tie_word_embeddings", default=False))
        vocab = config_value(config, "vocab_size")
        self.model = DecoderBackbone(vocab, hidden, layers, eps, dtype, self.stage, self.tie_word_embeddings)
        if self.tie_word_embeddings:
            self.lm_head = None
        elif self.stage.is_last:
            self.lm_head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        else:
            self.lm_head = MissingLayer()
        self.requires_grad_(False)
        self.eval()

    # -- what a family defines ------------------------------------------------------------

    def build_attention(self, layer_idx: int) -> Attention:
        raise NotImplementedError

    def build_mlp(self, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def rename(self, name: str) -> str:
        """Map a checkpoint tensor name to this model's naming."""
        return name

    # -- shared helpers for the families --------------------------------------------------

    def head_dim(self) -> int:
        config = self.config
        return config_value(
            config, "head_dim", default=config_value(config, "hidden_size") // config_value(config, "num_attention_heads")
        )

    #: `rope_theta` when the config names none (the family's reference default).
    default_rope_theta: float = 10000.0

    def attention(self, **options) -> Attention:
        """The family's self-attention from the config; `options` are the family's extras
        (biases, QK norm)."""
        config = self.config
        return Attention(
            config_value(config, "hidden_size"),
            config_value(config, "num_attention_heads"),
            config_value(config, "num_key_value_heads", "num_attention_heads"),
            self.head_dim(),
            rope_theta=rope_theta(config, default=self.default_rope_theta),
            dtype=self.dtype,
            **options,
        )

    def sliding_window(self) -> int | None:
        """The attention window if one applies; `max_model_len` is capped to it, where a
        windowed model and full attention agree."""
        return None

    # -- CausalLM -------------------------------------------------------------------------

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers[self.stage.start : self.stage.end]]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """On a later pipeline stage `input_ids` are the previous stage's hidden states."""
        hidden = self.model.embed_tokens(input_ids) if self.stage.is_first else input_ids
        for layer in self.model.layers[self.stage.start : self.stage.end]:
            hidden = layer(positions, hidden)
        return self.model.norm(hidden) if self.stage.is_last else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [attn.kv_cache_spec() for attn in self.attention_layers()]

    def bind_kv_cache(self, caches: list[dict[str, torch.Tensor]]) -> None:
        layers = self.attention_layers()
        if len(caches) != len(layers):
            raise ValueError(f"got {len(caches)} KV caches for {len(layers)} attention layers")
        for attn, cache in zip(layers, caches):
            missing = {"key", "value"} - set(cache)
            if missing:
                raise ValueError(f"KV cache dict lacks {sorted(missing)}")
            attn.kv_cache = cache

    # -- weights --------------------------------------------------------------------------

    def _stacked_experts(self) -> dict[str, StackedExperts]:
        return {name: m for name, m in self.named_modules() if isinstance(m, StackedExperts)}

    def checkpoint_selection(self, name: str) -> bool | range:
        """What the loader should read of checkpoint tensor `name`: `True` all of it,
        `False` nothing (an expert another rank holds), a range: only those rows of dim 0
        (this rank's experts of a fused expert tensor)."""
        if not self.owns_checkpoint_tensor(name):
            return False
        target = self.rename(name)
        experts = self._stacked_experts()
        match = _PER_EXPERT.match(target)
        if match and match["prefix"] in experts:
            return experts[match["prefix"]].is_local(int(match["expert"]))
        match = _FUSED.match(target)
        if match and match["prefix"] in experts:
            local = experts[match["prefix"]].local
            return range(local.start, local.stop)
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        experts = self._stacked_experts()
        loaded: set[str] = set()
        for name, tensor in weights:
            if not self.owns_checkpoint_tensor(name):
                continue  # another pipeline stage's
            target = self.rename(name)
            if target in params:
                param = params[target]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"parameter {target!r} expects {tuple(param.shape)}"
                    )
                param.data.copy_(tensor)
                loaded.add(target)
                continue
            match = _PER_EXPERT.match(target)
            if match and match["prefix"] in experts:
                experts[match["prefix"]].load_expert(int(match["expert"]), match["proj"], tensor, name)
                continue
            match = _FUSED.match(target)
            if match and match["prefix"] in experts:
                experts[match["prefix"]].load_fused(match["kind"], tensor, name)
                continue
            if _IGNORED.search(target) or (self.lm_head is None and target == "lm_head.weight"):
                continue
            raise KeyError(
                f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__} "
                f"(is the checkpoint for a different architecture or config?)"
            )
        for prefix, module in experts.items():
            loaded.update(f"{prefix}.{param}" for param in module.loaded_parameters())
        return loaded
