"""Rotary position embedding: the RoPE settings of an HF config, the inverse frequencies
they give (plain, or YaRN-scaled as in transformers' `_compute_yarn_parameters`), and the
module that rotates queries and keys by position.

Two layouts of the rotated pairs: rotate-half (Neox: pairs `(x[i], x[i + D/2])`, Qwen,
Mixtral, DeepSeek-V3 with `rope_interleave=false`) and interleaved (pairs `(x[2i],
x[2i+1])`, DeepSeek-V2 and V3). The interleaved result is written de-interleaved, evens then
odds, as HF's DeepSeek-V3 does: the dot products are those of rotating in place, and the
query and key both go through the same permutation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from tandem.models.hf_config import config_value


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


def rope_config(config: Any, *, supported: tuple[str, ...] = ("default",), default_theta: float = 10000.0) -> RopeConfig:
    """The RoPE settings of an HF config, old style (`rope_theta` + `rope_scaling`) or
    transformers-5 style (`rope_parameters`); a type outside `supported` (what the family
    has been checked against) is refused."""
    params = dict(config_value(config, "rope_parameters", default=None) or config_value(config, "rope_scaling", default=None) or {})
    if any(isinstance(value, Mapping) for value in params.values()):
        raise NotImplementedError("per-layer-type rope parameters are not supported")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in supported:
        raise NotImplementedError(f"RoPE type {rope_type!r} is not supported for this model; supported: {', '.join(supported)}")
    theta = float(params.get("rope_theta") or config_value(config, "rope_theta", default=default_theta))
    if rope_type == "default":
        return RopeConfig("default", theta)
    max_pos = int(config_value(config, "max_position_embeddings", default=4096))
    original = params.get("original_max_position_embeddings") or config_value(
        config, "original_max_position_embeddings", default=max_pos
    )
    factor = params.get("factor")
    return RopeConfig(
        "yarn",
        theta,
        factor=float(max_pos / original if factor is None else factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
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
        attention_factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(rope.factor)

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


class RotaryEmbedding(nn.Module):
    """Rotates the last dim of `x [T, heads, dim]` by position (see the module docstring for
    the two pair layouts)."""

    def __init__(self, dim: int, rope: RopeConfig, *, interleaved: bool = False):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary embedding needs an even dimension, got {dim}")
        inv_freq, self.attention_factor = rope_frequencies(rope, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleaved = interleaved

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`[T, 1, dim // 2]` each, broadcasting over heads."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`q [T, Hq, D]`, `k [T, Hkv, D]` at `positions [T]`."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)


__all__ = ["RopeConfig", "RotaryEmbedding", "rope_config", "rope_frequencies", "yarn_mscale"]
