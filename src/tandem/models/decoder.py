"""The decoder skeleton every family shares (embed → [norm, attention, norm, MLP or MoE] × L
→ norm → lm_head), and loading HF-named tensors into it. A family (`qwen_moe.py`,
`mixtral.py`, `deepseek.py`) builds one layer's attention and MLP; the layer signature is
`layer(positions, hidden, residual=None) -> (hidden, residual)` and an attention's is
`attention(positions, x)` for all of them.

A layer hands its MLP output and the residual on unsummed (as vLLM's decoder layers do): the
next layer's input norm, or the model's final norm, adds them in its fused add + norm (one
kernel on CUDA and on the CPU), with the same roundings as the add then the norm. A pipeline
stage that is not the last hands the next stage the sum."""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

from tandem.distributed.partition import MissingLayer, StageLayers, build_layers
from tandem.models.base import CausalLM, KVCacheSpec
from tandem.modular_kernels import MoEConfig
from tandem.models.hf_config import as_config, check_silu, config_value
from tandem.models.layer_operations import DecoderLayerOperations, OperationsModel
from tandem.models.layers import Attention, StackedExperts
from tandem.models.norm import RMSNorm
from tandem.models.rope import RopeConfig, RotaryEmbedding, rope_config
from tandem.models.linear import Linear
from tandem.platform.cpu_gemm import linear

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)(\.weight)?$")
#: HF's separate halves of a `GatedMLP`'s fused `gate_up_proj`.
_GATE_UP_HALF = re.compile(r"^(?P<prefix>.+)\.(?P<half>gate_proj|up_proj)\.weight$")
#: Checkpoint tensors no model here needs (old HF checkpoints saved RoPE buffers).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")


class UnknownCheckpointTensorError(KeyError, ValueError):
    """Checkpoint tensors that match no parameter: a lookup that failed (KeyError) on a
    checkpoint that does not fit the model (ValueError)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class DecoderLayer(DecoderLayerOperations, nn.Module):
    """`self_attn` is any attention with `forward(positions, x)`, `prepare`, `core`,
    `kv_cache_spec()` and a `kv_cache` dict (`Attention`, `MLAttention`)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, dtype: torch.dtype, mlp_name: str):
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

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(MLP output, residual)`, unsummed. `residual` is the previous layer's (None for the
        first layer, whose `hidden` is the residual): the input norm adds it to `hidden`."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        attn_out = self.self_attn(positions, hidden)
        normed, residual = self.post_attention_layernorm(attn_out, residual)
        return self.feed_forward(normed), residual


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
    ...), except the routed experts, stacked as `...experts.w13` / `...experts.w2`, and a
    dense MLP's `gate_up_proj`, which HF's `gate_proj` and `up_proj` fill. Subclasses build
    one layer's attention and MLP, and may rename or skip checkpoint names."""

    #: attribute name of the MLP / MoE block in a decoder layer (Mixtral: block_sparse_moe).
    mlp_name = "mlp"

    def __init__(
        self, config: Any, moe: MoEConfig | None = None, dtype: torch.dtype = torch.float32, stage: StageLayers | None = None
    ):
        super().__init__()
        self.config = config = as_config(config)
        self.moe = moe or MoEConfig()
        self.dtype = dtype
        # One rotary embedding (and cos/sin table) per (dim, layout), shared by the layers.
        self._rotaries: dict[tuple, RotaryEmbedding] = {}
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
            self.lm_head = Linear(hidden, vocab, bias=False, dtype=dtype)
        else:
            self.lm_head = MissingLayer()
        self.requires_grad_(False)
        self.eval()

    # -- what a family defines ------------------------------------------------------------

    def build_attention(self, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def build_mlp(self, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def rename(self, name: str) -> str:
        """Map a checkpoint tensor name to this model's naming."""
        return name

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """A checkpoint tensor the family reads past (DeepSeek's multi-token-prediction layers)."""
        return False

    # -- shared helpers for the families --------------------------------------------------

    def head_dim(self) -> int:
        config = self.config
        return config_value(
            config, "head_dim", default=config_value(config, "hidden_size") // config_value(config, "num_attention_heads")
        )

    #: `rope_theta` when the config names none (the family's reference default).
    default_rope_theta: float = 10000.0
    #: RoPE types checked against the family's reference implementation.
    rope_types: tuple[str, ...] = ("default",)

    def shared_rotary(self, dim: int, rope: RopeConfig, *, interleaved: bool = False) -> RotaryEmbedding:
        """The model's one rotary embedding for `(dim, rope, interleaved)`: its cos/sin table
        exists once, and a step's gather of it is reused by every layer."""
        key = (dim, rope, interleaved)
        if key not in self._rotaries:
            self._rotaries[key] = RotaryEmbedding(dim, rope, interleaved=interleaved)
        return self._rotaries[key]

    def attention(self, **options) -> Attention:
        """The family's self-attention from the config; `options` are the family's extras
        (biases, QK norm)."""
        config = self.config
        rope = rope_config(config, supported=self.rope_types, default_theta=self.default_rope_theta)
        return Attention(
            config_value(config, "hidden_size"),
            config_value(config, "num_attention_heads"),
            config_value(config, "num_key_value_heads", "num_attention_heads"),
            self.head_dim(),
            rope=rope,
            rotary=self.shared_rotary(self.head_dim(), rope),
            dtype=self.dtype,
            **options,
        )

    def sliding_window(self) -> int | None:
        """The attention window if one applies; `max_model_len` is capped to it, where a
        windowed model and full attention agree."""
        return None

    # -- CausalLM -------------------------------------------------------------------------

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.model.layers[self.stage.start : self.stage.end]]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """On a later pipeline stage `input_ids` are the previous stage's hidden states."""
        hidden = self.model.embed_tokens(input_ids) if self.stage.is_first else input_ids
        residual = None
        for layer in self.model.layers[self.stage.start : self.stage.end]:
            hidden, residual = layer(positions, hidden, residual)
        return self.finish_stage(hidden, residual)

    def finish_stage(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's `(hidden, residual)` summed: through the final norm's fused add +
        norm on the last stage, a plain add for the next stage to take (`residual + hidden`,
        the add the layer used to end with)."""
        if self.stage.is_last:
            return self.model.norm(hidden) if residual is None else self.model.norm.add_norm(hidden, residual)
        return hidden if residual is None else residual + hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [attn.kv_cache_spec() for attn in self.attention_layers()]

    def bind_kv_cache(self, caches: list[dict[str, torch.Tensor]]) -> None:
        layers = self.attention_layers()
        if len(caches) != len(layers):
            raise ValueError(f"got {len(caches)} KV caches for {len(layers)} attention layers")
        for i, (attn, cache) in enumerate(zip(layers, caches), start=self.stage.start):
            spec = attn.kv_cache_spec()
            if set(cache) != set(spec.shapes):
                raise ValueError(f"layer {i} KV cache has tensors {sorted(cache)}, expected {sorted(spec.shapes)}")
            for name, shape in spec.shapes.items():
                if tuple(cache[name].shape[2:]) != tuple(shape):
                    raise ValueError(
                        f"layer {i} KV cache {name!r} has shape {tuple(cache[name].shape)}, "
                        f"expected [blocks, block_size, *{shape}]"
                    )
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
        gate_up_halves: dict[str, set[str]] = {}
        loaded: set[str] = set()
        unknown: list[str] = []

        def copy(name: str, target: str, tensor: torch.Tensor, rows: slice = slice(None)) -> None:
            dest = params[target].detach()[rows]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"parameter {target!r} expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)

        for name, tensor in weights:
            if not self.owns_checkpoint_tensor(name) or self.skips_checkpoint_tensor(name):
                continue  # another pipeline stage's, or one the family does not use
            target = self.rename(name)
            if target in params:
                copy(name, target, tensor)
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
            match = _GATE_UP_HALF.match(target)
            fused = match and f"{match['prefix']}.gate_up_proj.weight"
            if fused in params:
                half = params[fused].shape[0] // 2
                copy(name, fused, tensor, slice(0, half) if match["half"] == "gate_proj" else slice(half, 2 * half))
                gate_up_halves.setdefault(fused, set()).add(match["half"])
                continue
            if _IGNORED.search(target) or (self.lm_head is None and target == "lm_head.weight"):
                continue
            unknown.append(name)
        if unknown:
            shown = ", ".join(unknown[:20]) + (f", ... ({len(unknown)} in all)" if len(unknown) > 20 else "")
            raise UnknownCheckpointTensorError(
                f"checkpoint tensors that match no parameter of {type(self).__name__} (is the checkpoint for "
                f"a different architecture or config, or quantised?): {shown}"
            )
        loaded.update(fused for fused, halves in gate_up_halves.items() if len(halves) == 2)
        for prefix, module in experts.items():
            loaded.update(f"{prefix}.{param}" for param in module.loaded_parameters())
        return loaded
