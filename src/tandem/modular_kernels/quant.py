"""FP8 (e4m3) per-token-group quantization, the 1x128 layout DeepEP and DeepGEMM use."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
GROUP_SIZE = 128


def ceil_to_power_of_two(scales: torch.Tensor) -> torch.Tensor:
    """Positive float32 scales rounded up to powers of two (UE8M0: the exponent byte alone),
    as Blackwell's fp8 GEMMs take them."""
    bits = scales.float().contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    return (exponent.clamp(1, 254) << 23).view(torch.float32)


def quantize_fp8_per_token_group(
    x: torch.Tensor, group_size: int = GROUP_SIZE, *, power_of_two_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., H]` → `(q fp8 [..., H], scales float32 [..., H / group_size])`, x ≈ q * scale;
    with `power_of_two_scales` every scale is rounded up to a power of two (UE8M0)."""
    hidden = x.shape[-1]
    if hidden % group_size:
        raise ValueError(f"fp8 dispatch needs hidden size divisible by {group_size}, got {hidden}")
    groups = x.float().unflatten(-1, (hidden // group_size, group_size))
    scales = groups.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    if power_of_two_scales:
        scales = ceil_to_power_of_two(scales)
    q = (groups / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2), scales


def unpack_ue8m0(packed: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Packed UE8M0 scales (int32 `[..., ceil(G/4)]`, byte i of word j the exponent of group
    4j+i, as DeepEP's `use_ue8m0` dispatch and DeepGEMM's SM100 layout hold them) → float32
    powers of two `[..., G]`."""
    dense = torch.empty(packed.shape, dtype=torch.int32, device=packed.device).copy_(packed)  # row-major strides
    exponents = dense.view(torch.uint8)[..., :num_groups].to(torch.int32)
    return (exponents << 23).view(torch.float32)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`q` with per-token-group scales, float32 or packed UE8M0 (int32, 128-wide groups)."""
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales, q.shape[-1] // GROUP_SIZE)
    group_size = q.shape[-1] // scales.shape[-1]
    groups = q.float().unflatten(-1, (scales.shape[-1], group_size)) * scales.unsqueeze(-1)
    return groups.flatten(-2).to(dtype)


@dataclass(frozen=True)
class BlockFP8Weight:
    """Stacked expert weights `[E, N, K]` in fp8 e4m3 with one float32 scale per 128x128
    block (`scales [E, N/128, K/128]`, `weight ≈ data * scale`): what an experts backend
    that computes in fp8 keeps instead of the model-dtype tensor. It answers the shape
    questions a weight tensor does, and slices by expert."""

    data: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return self.data.dim()

    def __getitem__(self, experts: slice) -> "BlockFP8Weight":
        if not isinstance(experts, slice):
            raise TypeError(f"a BlockFP8Weight is sliced by a range of experts, got {type(experts).__name__}")
        return BlockFP8Weight(self.data[experts], self.scales[experts])
