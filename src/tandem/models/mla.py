"""Multi-head latent attention (DeepSeek-V2/V3) over the paged cache, with the layer
signature every attention here has: `forward(positions, x)`, split into `prepare` and
`core` for TBO, the metadata read from the forward context.

Queries come either straight from `q_proj` or through the low-rank `q_a_proj` ->
`q_a_layernorm` -> `q_b_proj`; keys and values from the shared latent `kv_a_proj_with_mqa`
(`kv_lora_rank` latent + one `qk_rope_head_dim` rotary key shared by all heads), normalised
by `kv_a_layernorm` and expanded per head by `kv_b_proj`. RoPE touches only the rope part.
On CUDA the two projections of the hidden state (`q_proj` or `q_a_proj`, and
`kv_a_proj_with_mqa`) are one GEMM over their weights joined (`join_input_projections`).
The softmax scale is `qk_head_dim ** -0.5`, times `mscale(factor, mscale_all_dim) ** 2`
under YaRN.

The cache holds the latent, not per-head keys and values: per token one row of
`kv_lora_rank + qk_rope_head_dim` (the normalised latent, then the rotated shared key).
Decode attends in the latent space ("weight absorption"): each head's `q_nope` is folded
through its slice of `kv_b_proj` into the latent, so the cached latent serves as both key
(with the rope part) and value of one shared KV head, and the attended latent is expanded
to `v_head_dim` afterwards. Prefill expands the cached latent per head instead and runs
plain multi-head attention at d_qk 192 / d_v 128, 3.4x fewer FLOPs (`mla_prefill.py` says
when each form is taken). `kv_cache_mode="expanded"` caches the decompressed per-head K
and V instead (plain attention; the reference the latent path is checked against).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.base import KVCacheSpec
from tandem.models.deepseek_config import DeepseekConfig
from tandem.models.layers import current_attention_metadata, opaque_attend
from tandem.models.mla_prefill import mla_latent_attention
from tandem.models.norm import RMSNorm
from tandem.models.paged_attention import paged_attention, write_to_cache
from tandem.models.rope import RotaryEmbedding, yarn_mscale
from tandem.models.linear import Linear
from tandem.platform import triton_utils
from tandem.platform.cpu_gemm import linear

KV_CACHE_MODES = ("latent", "expanded")


def mla_softmax_scale(cfg: DeepseekConfig) -> float:
    scale = cfg.qk_head_dim**-0.5
    if cfg.rope.rope_type != "default" and cfg.rope.mscale_all_dim:
        m = yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim)
        scale *= m * m
    return scale


class MLAttention(nn.Module):
    def __init__(
        self, cfg: DeepseekConfig, dtype: torch.dtype, kv_cache_mode: str = "latent", rotary: RotaryEmbedding | None = None
    ):
        super().__init__()
        if kv_cache_mode not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache_mode must be one of {KV_CACHE_MODES}, got {kv_cache_mode!r}")
        self.cfg = cfg
        self.kv_cache_mode = kv_cache_mode
        self.dtype = dtype
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = nh
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(H, nh * cfg.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = Linear(H, cfg.q_lora_rank, bias=cfg.attention_bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, dtype=dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.attention_bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, dtype=dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False, dtype=dtype)
        self.o_proj = Linear(nh * cfg.v_head_dim, H, bias=cfg.attention_bias, dtype=dtype)
        if rotary is None:
            rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope, interleaved=cfg.rope_interleave)
        self.rotary = rotary
        self.scale = mla_softmax_scale(cfg)
        self.kv_cache: dict[str, torch.Tensor] | None = None
        #: `[query (or its low-rank part) rows; latent + rope rows]`, set by `join_input_projections`.
        self.joined_input_weight: torch.Tensor | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        c = self.cfg
        if self.kv_cache_mode == "latent":
            return KVCacheSpec({"kv_latent": (1, c.kv_lora_rank + c.qk_rope_head_dim)}, self.dtype)
        return KVCacheSpec({"key": (self.num_heads, c.qk_head_dim), "value": (self.num_heads, c.v_head_dim)}, self.dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.core(self.prepare(positions, x))

    def prepare(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Query and latent projections (TBO's attention prepare): `(positions, q_nope,
        q_rope, latent, k_rope)`, the rope parts not yet rotated, the latent normalised
        unless the RoPE kernel normalises it as it writes the cache (`attend`)."""
        c, T, nh = self.cfg, x.shape[0], self.num_heads
        query_input, kv_a = self._input_projections()
        if self.joined_input_weight is not None:
            q, kv = linear(x, self.joined_input_weight).split([query_input.out_features, kv_a.out_features], dim=-1)
        else:
            q, kv = query_input(x), kv_a(x)
        if c.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_rope = q.view(T, nh, c.qk_head_dim).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_rope = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        if not self._cache_write_normalises(latent):
            latent = self.kv_a_layernorm(latent)
        return positions, q_nope, q_rope, latent, k_rope.unsqueeze(1)  # k_rope [T, 1, rope]

    def _input_projections(self) -> tuple[Linear, Linear]:
        """The two projections of the hidden state: the query's (`q_proj`, or `q_a_proj`
        under a query LoRA) and the latent's."""
        return (self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj), self.kv_a_proj_with_mqa

    def prepare_loaded_weights(self) -> None:
        """On CUDA, one GEMM for both input projections: a decode step's few rows make each
        a launch of its own (on the CPU the two packed GEMMs stay as they are)."""
        if self.kv_a_proj_with_mqa.weight.device.type == "cuda":
            self.join_input_projections()

    def join_input_projections(self) -> None:
        """Join the two input projections' weights into `joined_input_weight`, the modules'
        weights becoming views of its rows (no second copy; a later load into them lands in
        it). Left apart where either has a bias."""
        projections = self._input_projections()
        if self.joined_input_weight is not None or any(p.bias is not None for p in projections):
            return
        joined = torch.cat([p.weight.detach() for p in projections])
        for projection, rows in zip(projections, joined.split([p.out_features for p in projections])):
            projection.weight.data = rows
        self.joined_input_weight = joined

    def _cache_write_normalises(self, latent: torch.Tensor) -> bool:
        """Whether `kv_a_layernorm` runs inside the Triton RoPE + cache-write kernel (the
        latent cache on CUDA: the normalised latent is read from the cache only) rather
        than as its own kernel in `prepare`."""
        return self.kv_cache_mode == "latent" and triton_utils.use_triton(latent)

    def core(self, prepared: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """`attend`, then the output projection (TBO's attention core)."""
        return self.o_proj(opaque_attend(self, prepared))

    @property
    def attend_width(self) -> int:
        return self.num_heads * self.cfg.v_head_dim

    def attend(self, prepared: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Rotary embedding and cache write (one kernel on CUDA in latent mode) and attention
        (latent or expanded): `[T, heads * v_head_dim]` (the compiled step's opaque
        `tandem::attention`)."""
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound: call model.bind_kv_cache(...) before the forward")
        positions, q_nope, q_rope, latent, k_rope = prepared
        metadata = current_attention_metadata()
        c, T, nh = self.cfg, q_nope.shape[0], self.num_heads
        if self.kv_cache_mode == "latent":
            cache = self.kv_cache["kv_latent"]
            rank = c.kv_lora_rank
            # The cache row is [normalised latent, rotated shared key].
            norm = self.kv_a_layernorm
            q_rope = self.rotary.rotate_and_cache(
                positions, q_rope, k_rope, metadata.slot_mapping, cache[..., rank:],
                copy=(latent.unsqueeze(1), cache[..., :rank]),
                normalise_copy=(norm.weight, norm.eps) if self._cache_write_normalises(latent) else None,
            )  # fmt: skip
            out = mla_latent_attention(self, q_nope, q_rope, cache, metadata)
        else:
            q_rope, k_rope = self.rotary(positions, q_rope, k_rope)
            kv = linear(latent, self.kv_b_proj.weight).view(T, nh, -1)
            k_nope, value = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
            key = torch.cat((k_nope, k_rope.expand(T, nh, c.qk_rope_head_dim)), dim=-1)
            write_to_cache(self.kv_cache["key"], key, metadata.slot_mapping)
            write_to_cache(self.kv_cache["value"], value, metadata.slot_mapping)
            query = torch.cat((q_nope, q_rope), dim=-1)
            out = paged_attention(query, self.kv_cache["key"], self.kv_cache["value"], metadata, self.scale)
        return out.reshape(T, self.attend_width)


__all__ = ["KV_CACHE_MODES", "MLAttention", "mla_softmax_scale"]
