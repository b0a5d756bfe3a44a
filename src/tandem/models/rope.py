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
from tandem.models.norm import rms_norm
from tandem.models.paged_attention import write_to_cache
from tandem.models.rope_kernel import rope_and_cache_triton
from tandem.platform import cpu_kernels, triton_utils


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
    #: positions the cos/sin cache covers (the config's `max_position_embeddings`).
    max_positions: int = 4096


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
    max_pos = int(config_value(config, "max_position_embeddings", default=4096))
    if rope_type == "default":
        return RopeConfig("default", theta, max_positions=max_pos)
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
        max_positions=max_pos,
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


def cos_sin_table(rope: RopeConfig, dim: int) -> torch.Tensor:
    """`[max_positions, dim]` float32: `cos` of every position's angles in the first half,
    `sin` in the second, both times the attention factor."""
    # On the host whatever the default device: the same table on every device.
    with torch.device("cpu"):
        inv_freq, attention_factor = rope_frequencies(rope, dim)
        freqs = torch.arange(rope.max_positions, dtype=torch.float32).unsqueeze(-1) * inv_freq
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor


class RotaryEmbedding(nn.Module):
    """Rotates the last dim of `x [T, heads, dim]` by position (see the module docstring for
    the two pair layouts).

    The cos/sin table is computed once, when the module is built; a model shares one module
    among its layers (`MoEDecoderForCausalLM.shared_rotary`), and the rows of a step's
    positions are gathered once and reused by every layer (on CUDA the fused kernel reads
    the table directly and gathers nothing)."""

    def __init__(self, dim: int, rope: RopeConfig, *, interleaved: bool = False):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary embedding needs an even dimension, got {dim}")
        self.register_buffer("cos_sin_cache", cos_sin_table(rope, dim).to(torch.get_default_device()), persistent=False)
        self.interleaved = interleaved
        # The last gather: (positions, its version, dtype) -> (cos, sin). A step's layers pass
        # the same positions tensor; an in-place update bumps its version and misses.
        self._gathered: tuple | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`[T, 1, dim // 2]` each, broadcasting over heads."""
        key = (positions, positions._version, dtype)
        last = self._gathered
        if last is not None and last[0] is key[0] and last[1:3] == key[1:]:
            return last[3], last[4]
        cos, sin = self.cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        self._gathered = (*key, cos, sin)
        return cos, sin

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

    def rotate_and_cache(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        copy: tuple[torch.Tensor, torch.Tensor] | None = None,
        normalise_copy: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """Rotate `q` and `k`, write the rotated `k` to `k_cache` (a `[blocks, block_size,
        Hk, D]` view) at `slot_mapping`, and `copy = (rows [T, ...], cache)` to the same slots,
        the rows RMS-normalised first with `normalise_copy = (weight, eps)` when given;
        returns the rotated `q`. One Triton kernel on CUDA (q rotated in place: pass a
        tensor nothing else reads; the norm inside it), one of tandem's kernels on the CPU (a
        new `q`, the same bits as the torch path), torch ops and `write_to_cache` elsewhere."""
        if triton_utils.use_triton(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
            rope_and_cache_triton(
                self.cos_sin_cache, positions, q, k, interleaved=self.interleaved,
                slot_mapping=slot_mapping, k_cache=k_cache, copy=copy, normalise_copy=normalise_copy,
            )  # fmt: skip
            return q
        if normalise_copy is not None:
            copy = (rms_norm(copy[0], *normalise_copy), copy[1])
        if copy is not None and cpu_kernels.takes(q, k, copy[0], k_cache, copy[1]):
            return cpu_kernels.rope_and_cache(positions, q, k, copy[0], self.cos_sin_cache, slot_mapping, k_cache,
                                              copy[1], self.interleaved)
        q, k = self(positions, q, k)
        write_to_cache(k_cache, k, slot_mapping)
        if copy is not None:
            write_to_cache(copy[1], copy[0], slot_mapping)
        return q


__all__ = ["RopeConfig", "RotaryEmbedding", "cos_sin_table", "rope_config", "rope_frequencies", "yarn_mscale"]
