"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) over a paged cache and
routed + shared experts through a `FusedMoEModularKernel`.

The math follows the Hugging Face implementations (`transformers.models.deepseek_v2` /
`deepseek_v3`):

- MLA: queries either straight from `q_proj` or through the low-rank `q_a_proj` ->
  `q_a_layernorm` -> `q_b_proj`; keys/values from the shared latent `kv_a_proj_with_mqa`
  (`kv_lora_rank` latent + one `qk_rope_head_dim` rotary key shared by all heads),
  normalised by `kv_a_layernorm` and expanded per head by `kv_b_proj`. Rotary embedding
  touches only the rope part, on interleaved pairs `(x0, x1), (x2, x3), ...` (V2 always,
  V3 unless `rope_interleave` is false, then rotate-half). The softmax scale is
  `qk_head_dim ** -0.5`, times `mscale(factor, mscale_all_dim) ** 2` under YaRN.
- Routing: V2 softmax + `greedy` or `group_limited_greedy` (groups ranked by their best
  expert); V3 sigmoid + `e_score_correction_bias` + `noaux_tc` (groups ranked by the sum of
  their two best biased scores, weights from the unbiased scores); renormalised when
  `norm_topk_prob`, then times `routed_scaling_factor`.

The cache holds the latent, not per-head keys and values: per token one row of
`kv_lora_rank + qk_rope_head_dim` (the normalised latent, then the rotated shared key).
Attention runs in the latent space ("weight absorption"): each head's `q_nope` is folded
through its slice of `kv_b_proj` into the latent, so the cached latent serves as both key
(with the rope part) and value of one shared KV head, and the attended latent is expanded
to `v_head_dim` afterwards. `kv_cache_mode="expanded"` caches the decompressed per-head K
and V instead (plain attention; the reference the latent path is checked against).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tandem.contexts import get_forward_context
from tandem.distributed.partition import MissingLayer, StageLayers, build_layers
from tandem.models.base import CausalLM, KVCacheSpec, MoEOptions
from tandem.models.layer_operations import DecoderLayerOperations, OperationsModel
from tandem.models.layers import current_attention_metadata
from tandem.models.paged_attention import AttentionMetadata, paged_attention, write_to_cache
from tandem.modular_kernels import select_experts

KV_CACHE_MODES = ("latent", "expanded")


# --------------------------------------------------------------------------- config


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str  # "default" or "yarn"
    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class DeepseekConfig:
    """The fields of an HF DeepSeek-V2/V3 config this implementation uses, normalised."""

    version: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int | None
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int | None
    topk_group: int | None
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    rope: RopeConfig
    rope_interleave: bool
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_nextn_predict_layers: int
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.n_routed_experts) and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @classmethod
    def from_hf(cls, config: Any, version: int) -> "DeepseekConfig":
        """From an HF config object or its `config.json` dict (old `rope_theta` +
        `rope_scaling` or transformers-5 `rope_parameters`)."""
        if isinstance(config, DeepseekConfig):
            return config
        act = _get(config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"DeepSeek with hidden_act={act!r}: only 'silu' is supported")
        if _get(config, "mlp_bias", False):
            raise NotImplementedError("DeepSeek with mlp_bias=True is not supported")
        heads = int(_get(config, "num_attention_heads"))
        kv_heads = int(_get(config, "num_key_value_heads", heads))
        if kv_heads != heads:
            raise ValueError(f"MLA expands keys/values to every head: num_key_value_heads={kv_heads} != {heads}")
        q_lora = _get(config, "q_lora_rank")
        return cls(
            version=version,
            vocab_size=int(_get(config, "vocab_size")),
            hidden_size=int(_get(config, "hidden_size")),
            intermediate_size=int(_get(config, "intermediate_size")),
            moe_intermediate_size=int(_get(config, "moe_intermediate_size", 0)),
            num_hidden_layers=int(_get(config, "num_hidden_layers")),
            num_attention_heads=heads,
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(_get(config, "kv_lora_rank")),
            qk_nope_head_dim=int(_get(config, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_get(config, "qk_rope_head_dim")),
            v_head_dim=int(_get(config, "v_head_dim")),
            n_routed_experts=_get(config, "n_routed_experts"),
            n_shared_experts=int(_get(config, "n_shared_experts", 0)),
            num_experts_per_tok=int(_get(config, "num_experts_per_tok", 1)),
            n_group=_get(config, "n_group"),
            topk_group=_get(config, "topk_group"),
            topk_method=str(_get(config, "topk_method", "greedy" if version == 2 else "noaux_tc")),
            scoring_func=str(_get(config, "scoring_func", "softmax" if version == 2 else "sigmoid")),
            norm_topk_prob=bool(_get(config, "norm_topk_prob", version == 3)),
            routed_scaling_factor=float(_get(config, "routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(_get(config, "first_k_dense_replace", 0)),
            moe_layer_freq=int(_get(config, "moe_layer_freq", 1)),
            rms_norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
            rope=_parse_rope(config),
            # V2 always rotates interleaved pairs; V3 lets the config choose.
            rope_interleave=True if version == 2 else bool(_get(config, "rope_interleave", True)),
            attention_bias=bool(_get(config, "attention_bias", False)),
            tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
            max_position_embeddings=int(_get(config, "max_position_embeddings", 4096)),
            num_nextn_predict_layers=int(_get(config, "num_nextn_predict_layers", 0)),
        )


def _parse_rope(config: Any) -> RopeConfig:
    params = _get(config, "rope_parameters") or _get(config, "rope_scaling") or {}
    params = dict(params)
    if any(isinstance(v, Mapping) for v in params.values()):
        raise NotImplementedError("per-layer-type rope parameters are not supported for DeepSeek")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta") or _get(config, "rope_theta", 10000.0))
    if rope_type == "default":
        return RopeConfig("default", theta)
    if rope_type != "yarn":
        raise NotImplementedError(f"DeepSeek rope type {rope_type!r}: only 'default' and 'yarn' are supported")
    max_pos = int(_get(config, "max_position_embeddings", 4096))
    original = params.get("original_max_position_embeddings") or _get(config, "original_max_position_embeddings", max_pos)
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / original
    return RopeConfig(
        "yarn",
        theta,
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """`(inv_freq [dim // 2], attention_factor)`: the factor multiplies cos and sin."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freqs = rope.theta**exponents
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(rope.factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # share of the original (unscaled) frequency
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def softmax_scale(cfg: DeepseekConfig) -> float:
    scale = cfg.qk_head_dim**-0.5
    if cfg.rope.rope_type != "default" and cfg.rope.mscale_all_dim:
        m = _yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim)
        scale *= m * m
    return scale


# --------------------------------------------------------------------------- layers


class Linear(nn.Module):
    """`y = x W^T (+ b)`, zero-initialised (weights come from `load_weights`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up fused into one `[2I, H]` weight."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class RotaryEmbedding(nn.Module):
    """Rotates the last dim of `x [T, heads, dim]` by position: interleaved pairs (the result
    de-interleaved, evens then odds, as HF V3 does; the same dot products as rotating in
    place) or rotate-half."""

    def __init__(self, rope: RopeConfig, dim: int, interleaved: bool):
        super().__init__()
        inv_freq, self.attention_factor = rope_frequencies(rope, dim)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.interleaved = interleaved

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: DeepseekConfig, dtype: torch.dtype, kv_cache_mode: str):
        super().__init__()
        self.cfg = cfg
        self.kv_cache_mode = kv_cache_mode
        self.dtype = dtype
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = nh
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(H, nh * cfg.qk_head_dim, dtype=dtype)
        else:
            self.q_a_proj = Linear(H, cfg.q_lora_rank, bias=cfg.attention_bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, dtype=dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.attention_bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, dtype=dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype=dtype)
        self.o_proj = Linear(nh * cfg.v_head_dim, H, bias=cfg.attention_bias, dtype=dtype)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave)
        self.scale = softmax_scale(cfg)
        self.cache: dict[str, torch.Tensor] | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        c = self.cfg
        if self.kv_cache_mode == "latent":
            return KVCacheSpec({"kv_latent": (1, c.kv_lora_rank + c.qk_rope_head_dim)}, self.dtype)
        return KVCacheSpec({"key": (self.num_heads, c.qk_head_dim), "value": (self.num_heads, c.v_head_dim)}, self.dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.core(self.prepare(positions, x), metadata)

    def prepare(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Query and latent projections with rotary embedding (TBO's attention prepare):
        `(q_nope, q_rope, latent, k_rope)`."""
        c, T, nh = self.cfg, x.shape[0], self.num_heads
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(T, nh, c.qk_head_dim).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        cos, sin = self.rotary.cos_sin(positions)
        q_rope = self.rotary.apply(q_rope, cos, sin)
        k_rope = self.rotary.apply(k_rope.unsqueeze(1), cos, sin)  # [T, 1, rope]
        return q_nope, q_rope, latent, k_rope

    def core(self, prepared: tuple[torch.Tensor, ...], metadata: AttentionMetadata) -> torch.Tensor:
        """Cache write, attention (latent or expanded), output projection (TBO's attention core)."""
        if self.cache is None:
            raise RuntimeError("attention layer has no KV cache: call bind_kv_cache() before forward()")
        q_nope, q_rope, latent, k_rope = prepared
        c, T, nh = self.cfg, q_nope.shape[0], self.num_heads
        w_kv = self.kv_b_proj.weight.view(nh, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        if self.kv_cache_mode == "latent":
            cache = self.cache["kv_latent"]
            write_to_cache(cache, torch.cat((latent.unsqueeze(1), k_rope), dim=-1), metadata.slot_mapping)
            # Fold each head's nope query through its key slice of kv_b_proj into the latent.
            q_latent = torch.einsum("thn,hnl->thl", q_nope, w_kv[:, : c.qk_nope_head_dim])
            query = torch.cat((q_latent, q_rope), dim=-1)
            out_latent = paged_attention(query, cache, cache[..., : c.kv_lora_rank], metadata, self.scale)
            out = torch.einsum("thl,hvl->thv", out_latent, w_kv[:, c.qk_nope_head_dim :])
        else:
            kv = F.linear(latent, self.kv_b_proj.weight).view(T, nh, -1)
            k_nope, value = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
            key = torch.cat((k_nope, k_rope.expand(T, nh, c.qk_rope_head_dim)), dim=-1)
            write_to_cache(self.cache["key"], key, metadata.slot_mapping)
            write_to_cache(self.cache["value"], value, metadata.slot_mapping)
            query = torch.cat((q_nope, q_rope), dim=-1)
            out = paged_attention(query, self.cache["key"], self.cache["value"], metadata, self.scale)
        return self.o_proj(out.reshape(T, nh * c.v_head_dim))


class Router(nn.Module):
    """`mlp.gate`: router logits in float32 (and V3's score-correction bias)."""

    def __init__(self, cfg: DeepseekConfig, dtype: torch.dtype):
        super().__init__()
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(E, cfg.hidden_size, dtype=dtype), requires_grad=False)
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class LocalExperts(nn.Module):
    """This rank's routed experts, stacked: `w1 [E_local, 2I, H]` (gate rows, then up rows)
    and `w2 [E_local, H, I]`."""

    def __init__(self, experts: range, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.experts = experts
        self.intermediate_size = intermediate_size
        n = len(experts)
        self.w1 = nn.Parameter(torch.zeros(n, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(n, hidden_size, intermediate_size, dtype=dtype), requires_grad=False)


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: DeepseekConfig, moe: MoEOptions, dtype: torch.dtype):
        super().__init__()
        E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.cfg = cfg
        self.gate = Router(cfg, dtype)
        self.experts = LocalExperts(moe.local_experts(E), cfg.hidden_size, cfg.moe_intermediate_size, dtype)
        self.shared_experts = (
            GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype)
            if cfg.n_shared_experts
            else None
        )
        grouped = cfg.topk_method in ("group_limited_greedy", "noaux_tc") and (cfg.n_group or 1) > 1
        if cfg.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise NotImplementedError(f"DeepSeek topk_method={cfg.topk_method!r} is not supported")
        self.num_expert_group = cfg.n_group if grouped else None
        self.topk_group = cfg.topk_group if grouped else None
        # A plain attribute, not a submodule: the kernel holds no parameters of its own.
        self.kernel = moe.build_kernel(
            num_experts=E, top_k=K, hidden_size=cfg.hidden_size, shared_experts=self.shared_experts
        )

    @property
    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.experts.w1, self.experts.w2

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, *self.expert_weights, *self.select(self.router_logits(x)))

    def select(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        return select_experts(
            router_logits,
            c.num_experts_per_tok,
            renormalize=c.norm_topk_prob,
            scoring=c.scoring_func,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            correction_bias=self.gate.e_score_correction_bias,
            routed_scaling_factor=c.routed_scaling_factor,
        )


class DecoderLayer(DecoderLayerOperations, nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer: int, moe: MoEOptions, dtype: torch.dtype, kv_cache_mode: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLAttention(cfg, dtype, kv_cache_mode)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = DeepseekMoE(cfg, moe, dtype) if self.is_moe else GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype)

    @property
    def feed_forward(self) -> nn.Module:
        return self.mlp

    def attention_core(self, prepared: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.self_attn.core(prepared, current_attention_metadata())

    def forward(self, h: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, metadata)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: DeepseekConfig, moe: MoEOptions, dtype: torch.dtype, kv_cache_mode: str, stage: StageLayers):
        super().__init__()
        if stage.owns_embedding(cfg.tie_word_embeddings):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
            self.embed_tokens.weight.requires_grad_(False)
            nn.init.zeros_(self.embed_tokens.weight)
        else:
            self.embed_tokens = MissingLayer()
        self.layers = build_layers(cfg.num_hidden_layers, lambda i: DecoderLayer(cfg, i, moe, dtype, kv_cache_mode), stage)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if stage.is_last else MissingLayer()


# --------------------------------------------------------------------------- model


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")
_MLP_SHARD = re.compile(r"^(mlp|mlp\.shared_experts)\.(gate_proj|up_proj|down_proj)\.weight$")
_DIRECT_IN_LAYER = re.compile(
    r"^(input_layernorm\.weight|post_attention_layernorm\.weight|mlp\.gate\.weight|mlp\.gate\.e_score_correction_bias"
    r"|self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.(weight|bias)"
    r"|self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight)$"
)


class _DeepseekForCausalLM(OperationsModel, CausalLM):
    version: int = 0

    def __init__(
        self,
        config: Any,
        moe: MoEOptions | None = None,
        dtype: torch.dtype = torch.float32,
        stage: StageLayers | None = None,
        *,
        kv_cache_mode: str = "latent",
    ):
        super().__init__()
        if kv_cache_mode not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache_mode must be one of {KV_CACHE_MODES}, got {kv_cache_mode!r}")
        self.config = DeepseekConfig.from_hf(config, self.version)
        self.hf_config = config
        self.moe = moe if moe is not None else MoEOptions()
        self.dtype = dtype
        self.stage = stage or StageLayers.whole(self.config.num_hidden_layers)
        self.model = DeepseekModel(self.config, self.moe, dtype, kv_cache_mode, self.stage)
        if self.config.tie_word_embeddings:
            self.lm_head = None
        elif self.stage.is_last:
            self.lm_head = Linear(self.config.hidden_size, self.config.vocab_size, dtype=dtype)
        else:
            self.lm_head = MissingLayer()

    def _own_layers(self) -> nn.ModuleList:
        return self.model.layers[self.stage.start : self.stage.end]

    # -- CausalLM

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        metadata = None if ctx is None else ctx.attn_metadata
        if metadata is None:
            raise RuntimeError("DeepSeek forward needs attention metadata: run it inside set_forward_context()")
        # On a later pipeline stage `input_ids` are the previous stage's hidden states.
        h = self.model.embed_tokens(input_ids) if self.stage.is_first else input_ids
        for layer in self._own_layers():
            h = layer(h, positions, metadata)
        return self.model.norm(h) if self.stage.is_last else h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [layer.self_attn.kv_cache_spec() for layer in self._own_layers()]

    def bind_kv_cache(self, caches: list[dict[str, torch.Tensor]]) -> None:
        specs = self.kv_cache_specs()
        if len(caches) != len(specs):
            raise ValueError(f"{len(caches)} caches for {len(specs)} attention layers")
        for i, (layer, cache, spec) in enumerate(zip(self._own_layers(), caches, specs), start=self.stage.start):
            if set(cache) != set(spec.shapes):
                raise ValueError(f"layer {i} cache has tensors {sorted(cache)}, expected {sorted(spec.shapes)}")
            for name, shape in spec.shapes.items():
                if tuple(cache[name].shape[2:]) != tuple(shape):
                    raise ValueError(
                        f"layer {i} cache {name!r} has shape {tuple(cache[name].shape)}, expected [blocks, block_size, *{shape}]"
                    )
            layer.self_attn.cache = cache

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unknown: list[str] = []

        def copy(target: str, tensor: torch.Tensor, rows: slice | None = None, index: int | None = None) -> None:
            dest = params[target]
            if index is not None:
                dest = dest[index]
            if rows is not None:
                dest = dest[rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"{source!r}: checkpoint shape {tuple(tensor.shape)} does not fit {target} {tuple(dest.shape)}")
            with torch.no_grad():
                dest.copy_(tensor)
            loaded.add(target)

        for source, tensor in weights:
            if not self.owns_checkpoint_tensor(source):
                continue  # another pipeline stage's
            if source.endswith("rotary_emb.inv_freq") or source.endswith("rotary_emb.cos_cached") or source.endswith("rotary_emb.sin_cached"):
                continue  # HF buffers, recomputed here
            if source in ("model.embed_tokens.weight", "model.norm.weight"):
                copy(source, tensor)
                continue
            if source == "lm_head.weight":
                if self.lm_head is not None:
                    copy(source, tensor)
                continue  # tied: the embedding already holds it
            m = _LAYER.match(source)
            if m is None:
                unknown.append(source)
                continue
            layer, rest = int(m.group(1)), m.group(2)
            if layer >= self.config.num_hidden_layers:
                if layer < self.config.num_hidden_layers + self.config.num_nextn_predict_layers:
                    continue  # multi-token-prediction layers: not used for decoding
                unknown.append(source)
                continue
            prefix = f"model.layers.{layer}."
            if _DIRECT_IN_LAYER.match(rest) and prefix + rest in params:
                copy(prefix + rest, tensor)
                continue
            m = _EXPERT.match(rest)
            if m is not None and self.config.is_moe_layer(layer):
                experts: LocalExperts = self.model.layers[layer].mlp.experts
                expert, proj = int(m.group(1)), m.group(2)
                if expert >= self.config.n_routed_experts:
                    unknown.append(source)
                    continue
                if expert not in experts.experts:
                    continue  # held by another expert-parallel rank
                local, inter = expert - experts.experts.start, experts.intermediate_size
                if proj == "down_proj":
                    copy(prefix + "mlp.experts.w2", tensor, index=local)
                else:
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    copy(prefix + "mlp.experts.w1", tensor, rows=rows, index=local)
                continue
            m = _FUSED_EXPERTS.match(rest)
            if m is not None and self.config.is_moe_layer(layer):
                experts = self.model.layers[layer].mlp.experts
                target = prefix + ("mlp.experts.w1" if m.group(1) == "gate_up_proj" else "mlp.experts.w2")
                if tensor.shape[0] != self.config.n_routed_experts:
                    raise ValueError(f"{source!r} holds {tensor.shape[0]} experts, expected {self.config.n_routed_experts}")
                copy(target, tensor[experts.experts.start : experts.experts.stop])
                continue
            m = _MLP_SHARD.match(rest)
            if m is not None:
                module, proj = m.group(1), m.group(2)
                mlp = self.model.layers[layer].mlp
                if module == "mlp":
                    target_module = None if isinstance(mlp, DeepseekMoE) else mlp
                else:
                    target_module = getattr(mlp, "shared_experts", None)
                if target_module is not None:
                    if proj == "down_proj":
                        copy(f"{prefix}{module}.down_proj.weight", tensor)
                    else:
                        inter = target_module.intermediate_size
                        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                        copy(f"{prefix}{module}.gate_up_proj.weight", tensor, rows=rows)
                    continue
            unknown.append(source)
        if unknown:
            shown = ", ".join(unknown[:20]) + (f", ... ({len(unknown)} in all)" if len(unknown) > 20 else "")
            raise ValueError(
                f"{type(self).__name__}.load_weights: checkpoint tensors with no place in this model "
                f"(wrong architecture or config, or an unsupported quantised checkpoint?): {shown}"
            )
        return loaded


class DeepseekV2ForCausalLM(_DeepseekForCausalLM):
    architectures = ("DeepseekV2ForCausalLM",)
    version = 2


class DeepseekV3ForCausalLM(_DeepseekForCausalLM):
    architectures = ("DeepseekV3ForCausalLM",)
    version = 3


__all__ = ["DeepseekConfig", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KV_CACHE_MODES"]
