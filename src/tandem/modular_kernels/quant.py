"""FP8 (e4m3) per-token-group quantization, the 1x128 layout DeepEP and DeepGEMM use."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
GROUP_SIZE = 128


def quantize_fp8_per_token_group(x: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., H]` → `(q fp8 [..., H], scales float32 [..., H / group_size])`, x ≈ q * scale."""
    hidden = x.shape[-1]
    if hidden % group_size:
        raise ValueError(f"fp8 dispatch needs hidden size divisible by {group_size}, got {hidden}")
    groups = x.float().unflatten(-1, (hidden // group_size, group_size))
    scales = groups.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    q = (groups / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    group_size = q.shape[-1] // scales.shape[-1]
    groups = q.float().unflatten(-1, (scales.shape[-1], group_size)) * scales.unsqueeze(-1)
    return groups.flatten(-2).to(dtype)
