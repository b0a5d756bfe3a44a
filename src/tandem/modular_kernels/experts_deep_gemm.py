"""Grouped expert GEMMs on DeepGEMM's FP8 kernels, in both activation formats.

Both adapters run the same two-GEMM expert MLP as `experts_torch`, with DeepGEMM's recipe:
activations in fp8 e4m3 with one float32 scale per token per 128 channels, weights in fp8
with one scale per 128x128 block, bf16 GEMM outputs. A model quantizes its expert weights
once at load (`prepare_weights`, a `BlockFP8Weight` each) and frees the model-dtype ones;
weights that still arrive in the model dtype are quantized once per tensor and the result
cached on the adapter until the tensor changes (another tensor, an in-place update, or new
storage). On SM100 the weight scales are also packed into DeepGEMM's UE8M0 layout once.

- `DeepGemmExperts` (STANDARD): the (token, k) pairs routed to this rank are permuted into
  DeepGEMM's contiguous layout (expert e's rows in one segment padded to the M alignment,
  `m_indices` -1 on padding rows), run through `m_grouped_fp8_gemm_nt_contiguous`
  (DeepGEMM 2.x names only), SiLU-and-mul, requantized, run through
  the second GEMM, then weighted and summed back per token. The row budget is a static
  upper bound (pairs + E * (alignment - 1)), so the permutation needs no host sync.
- `DeepGemmBatchedExperts` (MASKED): `[E, M, H]` goes straight to
  `m_grouped_fp8_gemm_nt_masked` with
  `masked_m = expert_num_tokens`; static shapes, no host sync, rows past the count zero.

`deep_gemm` is imported when an adapter is built, never at module import. It is not on
PyPI; on a CPU box `tandem.testing.fake_deep_gemm.install()` provides an emulation.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from tandem.modular_kernels.activation import silu_and_mul_torch
from tandem.modular_kernels.interfaces import ActivationFormat, Experts, ExpertTokens
from tandem.modular_kernels.per_tensor_cache import PerTensorCache
from tandem.modular_kernels.quant import (
    FP8_DTYPE,
    FP8_MAX,
    BlockFP8Weight,
    ceil_to_power_of_two,
    dequantize_fp8,
    quantize_fp8_per_token_group,
)

#: DeepGEMM's scaling block: 1x128 for activations, 128x128 for weights.
BLOCK = 128

_MISSING_MESSAGE = (
    "the 'deep_gemm' moe backend needs DeepGEMM (the `deep_gemm` Python module), which did not "
    "import. DeepGEMM is not on PyPI: install tandem's GPU extra (pip install 'tandem[gpu]'), then build "
    "DeepGEMM from its own source (https://github.com/deepseek-ai/DeepGEMM) against your CUDA toolkit, see "
    "README.md 'GPU extras'. On CPU, tandem.testing.fake_deep_gemm.install() provides an emulation for tests."
)


def import_deep_gemm() -> types.ModuleType:
    """`import deep_gemm`, with an error that says how to get it (DeepGEMM's import also
    asserts on CUDA_HOME and initialises its extension: any failure gets the message)."""
    try:
        import deep_gemm
    except Exception as err:  # noqa: BLE001
        raise ImportError(f"{_MISSING_MESSAGE} (`import deep_gemm` failed: {type(err).__name__}: {err})") from err
    return deep_gemm


def _function(dg: types.ModuleType, *names: str):
    for name in names:
        fn = getattr(dg, name, None)
        if fn is not None:
            return fn
    raise ImportError(f"the installed deep_gemm provides none of {', '.join(names)}; tandem needs DeepGEMM 2.x (2.6.1)")


def quantize_fp8_per_block(
    w: torch.Tensor, block: int = BLOCK, *, power_of_two_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [..., N, K]` → `(q fp8 [..., N, K], scales float32 [..., N/block, K/block])` with
    `w ≈ q * scale` per `block x block` tile (scales rounded up to powers of two with
    `power_of_two_scales`, as SM100 needs)."""
    n, k = w.shape[-2], w.shape[-1]
    if n % block or k % block:
        raise ValueError(f"block fp8 quantization needs both dims divisible by {block}, got {n}x{k}")
    tiles = w.detach().float().unflatten(-1, (k // block, block)).unflatten(-3, (n // block, block))
    # tiles: [..., N/b, b, K/b, b]
    scales = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-10) / FP8_MAX  # [..., N/b, K/b]
    if power_of_two_scales:
        scales = ceil_to_power_of_two(scales)
    q = (tiles / scales.unsqueeze(-1).unsqueeze(-3)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2).flatten(-3, -2).contiguous(), scales.contiguous()


def _quantize_experts(w: torch.Tensor, power_of_two_scales: bool) -> BlockFP8Weight:
    num_experts, n, k = w.shape
    data = torch.empty((num_experts, n, k), dtype=FP8_DTYPE, device=w.device)
    scales = torch.empty((num_experts, n // BLOCK, k // BLOCK), dtype=torch.float32, device=w.device)
    for e in range(num_experts):
        data[e], scales[e] = quantize_fp8_per_block(w[e], power_of_two_scales=power_of_two_scales)
    return BlockFP8Weight(data, scales)


def _check_hidden_sizes(w1: torch.Tensor | BlockFP8Weight, w2: torch.Tensor | BlockFP8Weight) -> tuple[int, int, int]:
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[1] % 2:
        raise ValueError(f"w1 must be [E, 2*I, H] and w2 [E, H, I], got {tuple(w1.shape)} and {tuple(w2.shape)}")
    num_experts, two_i, hidden = w1.shape
    inter = two_i // 2
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w2 must be [E={num_experts}, H={hidden}, I={inter}], got {tuple(w2.shape)}")
    if hidden % BLOCK or inter % BLOCK:
        raise ValueError(
            f"the deep_gemm moe backend needs hidden size H and intermediate size I to be multiples "
            f"of {BLOCK} (DeepGEMM's fp8 scaling block), got H={hidden}, I={inter}; use the 'torch' "
            "or 'triton' moe backend for this model"
        )
    return num_experts, hidden, inter


def _fp8_activations(
    tokens: ExpertTokens, power_of_two_scales: bool, sm100: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatched activations as fp8 + 1x128 scales, reused as they are when dispatch
    made them in the layout this device's GEMMs read: packed UE8M0 int32 scales on SM100
    (DeepEP low-latency with `use_ue8m0`), float32 ones elsewhere (DeepEP's are already
    column-major and TMA-aligned). Otherwise they are (re)quantized here: float32 scales
    on SM100 need not be powers of two, and checking would need a host sync."""
    hidden, scales = tokens.hidden, tokens.scales
    if scales is not None:
        if hidden.dtype == FP8_DTYPE and scales.dtype == torch.int32 and sm100:
            return hidden.contiguous(), scales
        if (
            not power_of_two_scales
            and hidden.dtype == FP8_DTYPE
            and scales.dtype == torch.float32
            and scales.shape[-1] * BLOCK == hidden.shape[-1]
        ):
            return hidden.contiguous(), scales
        hidden = dequantize_fp8(hidden, scales, torch.float32)
    q, s = quantize_fp8_per_token_group(hidden, BLOCK, power_of_two_scales=power_of_two_scales)
    return q.contiguous(), s.contiguous()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`[E, M, C]` with zero rows appended up to `rows`, in the same layout: packed UE8M0
    scales stay MN-major with a TMA-aligned column stride (`rows` is a multiple of 4)."""
    num_experts, m, cols = t.shape
    if t.dtype == torch.int32:
        out = t.new_zeros((num_experts, cols, rows)).transpose(1, 2)
        out[:, :m] = t
        return out
    return torch.cat([t, t.new_zeros((num_experts, rows - m, cols))], 1)


def _arch_major(device: torch.device) -> int | None:
    """Compute capability major of a CUDA device (a host query, no sync); None elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)[0]


def _needs_power_of_two_scales(device: torch.device) -> bool:
    """SM100 takes UE8M0 (power-of-two) scales, SM90 float32 ones; DeepGEMM's fp8 kernels
    run on nothing else. Off CUDA (the CPU emulation) the SM90 rules apply."""
    major = _arch_major(device)
    if major is None or major == 9:
        return False
    if major == 10:
        return True
    raise RuntimeError(
        f"DeepGEMM's fp8 grouped GEMMs run on SM90 (Hopper) and SM100 (Blackwell), not on this sm_{major}x "
        "device: use the triton or torch moe backend"
    )


def expected_rows_per_expert(rows: int, top_k: int | None, num_experts: int | None) -> int:
    """DeepGEMM's `expected_m` hint for a masked layout of `rows` rows per local expert
    (R ranks x T tokens): the mean rows an expert gets when every rank sends its whole
    budget and routing is balanced, `rows * top_k / E_global`, rounded up to 16 (as vLLM
    does) and kept within [1, rows]. Without the routing (an adapter built on its own) the
    hint is `rows`, the worst case. A host int from shapes: no device value is read."""
    if top_k is None or num_experts is None:
        return rows
    estimate = -(-rows * top_k // num_experts)
    estimate = -(-estimate // 16) * 16
    return max(1, min(estimate, rows))


class _DeepGemmBase(Experts):
    compiles_on_first_use = True
    name = "deep_gemm"

    @classmethod
    def from_moe_config(cls, config, *, num_experts: int, top_k: int) -> _DeepGemmBase:
        return cls(top_k=top_k, num_experts=num_experts)

    def __init__(
        self, power_of_two_scales: bool | None = None, *, top_k: int | None = None, num_experts: int | None = None
    ) -> None:
        """`power_of_two_scales`: UE8M0 scales; None decides per device (SM100: yes).
        `top_k` and `num_experts` (global) describe the routing the experts serve:
        `MoEConfig.build_kernel` gives them; the masked GEMM's `expected_m` hint comes from them."""
        self._dg = import_deep_gemm()
        self.top_k, self.num_experts = top_k, num_experts
        #: block-quantized copies of model-dtype weights, per (weight, UE8M0 or not).
        self._weights = PerTensorCache()
        #: SM100: weight scales packed into DeepGEMM's UE8M0 layout, per scale tensor.
        self._packed_weight_scales = PerTensorCache()
        self.power_of_two_scales = power_of_two_scales
        self._tma_align = _function(self._dg, "get_mn_major_tma_aligned_tensor")

    def _formats(self, device: torch.device) -> tuple[bool, bool]:
        """`(power-of-two scales, SM100 layouts)` for the GEMMs on `device`: SM100 reads
        UE8M0 (power-of-two) scales packed four to an int32, SM90 float32 ones."""
        if self.power_of_two_scales is None:
            return _needs_power_of_two_scales(device), _arch_major(device) == 10
        return self.power_of_two_scales, _arch_major(device) == 10

    def takes_ue8m0_scales(self, device: torch.device) -> bool:
        return all(self._formats(device))

    def _lhs_scales(self, scales: torch.Tensor, sm100: bool) -> torch.Tensor:
        """LHS scales as the GEMM should get them. SM90: MN-major and TMA-aligned, so the
        library does not transpose them on every call (a no-op for DeepEP's). SM100:
        packed UE8M0 as they are; float32 ones row-major, which the library packs with its
        kernel (an MN-major 3-D copy would send it to its slow torch fallback)."""
        if scales.dtype == torch.int32:
            return scales
        return scales.contiguous() if sm100 else self._tma_align(scales)

    def prepare_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> tuple[BlockFP8Weight, BlockFP8Weight]:
        """Both weights block-quantized for the GEMMs on their device (power-of-two scales on
        SM100), one expert at a time so the float32 working copy stays one expert's size."""
        _check_hidden_sizes(w1, w2)
        power_of_two, _ = self._formats(w1.device)
        return _quantize_experts(w1, power_of_two), _quantize_experts(w2, power_of_two)

    def _weight_operand(
        self, w: torch.Tensor | BlockFP8Weight, power_of_two: bool, sm100: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(fp8 data, scales)` of one weight: as prepared, or block-quantized once per weight
        version; on SM100 the scales are also packed into the UE8M0 layout once (the library
        would repack float32 weight scales on every call)."""
        if isinstance(w, BlockFP8Weight):
            q, scales = w.data, w.scales
        else:
            q, scales = self._weights.get(w, power_of_two, lambda: quantize_fp8_per_block(w, power_of_two_scales=power_of_two))
        if not sm100:
            return q, scales
        num_experts, n, k = q.shape

        def pack() -> torch.Tensor:
            transform = _function(self._dg, "transform_sf_into_required_layout")
            return transform(scales, n, k, (1, BLOCK, BLOCK), num_experts, is_sfa=False)

        return q, self._packed_weight_scales.get(scales, None, pack)

    def _quantized_weights(self, w1: torch.Tensor, w2: torch.Tensor, power_of_two: bool, sm100: bool):
        return self._weight_operand(w1, power_of_two, sm100), self._weight_operand(w2, power_of_two, sm100)


class DeepGemmExperts(_DeepGemmBase):
    """STANDARD format on DeepGEMM's contiguous-layout grouped GEMM."""

    activation_format = ActivationFormat.STANDARD

    def __init__(
        self, power_of_two_scales: bool | None = None, *, top_k: int | None = None, num_experts: int | None = None
    ) -> None:
        super().__init__(power_of_two_scales, top_k=top_k, num_experts=num_experts)
        dg = self._dg
        self._gemm = _function(dg, "m_grouped_fp8_gemm_nt_contiguous")
        self.alignment = int(_function(dg, "get_mk_alignment_for_contiguous_layout")())

    def apply(self, tokens: ExpertTokens, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        num_experts, hidden, inter = _check_hidden_sizes(w1, w2)
        ids, weights = tokens.topk_ids, tokens.topk_weights
        num_tokens, top_k = ids.shape
        device = tokens.hidden.device
        if num_tokens == 0:
            return torch.zeros((0, hidden), dtype=tokens.dtype, device=device)
        pow2, sm100 = self._formats(device)
        xq, xs = _fp8_activations(tokens, pow2, sm100)
        (w1q, w1s), (w2q, w2s) = self._quantized_weights(w1, w2, pow2, sm100)

        # Contiguous layout: pair p (token p // top_k) goes to row start[e] + its rank among
        # expert e's pairs; every segment is padded to the alignment; rows past the last
        # segment, padding rows and the spare row `m_sum` (invalid pairs) carry -1.
        align = self.alignment
        num_pairs = num_tokens * top_k
        flat = ids.reshape(-1).to(device=device, dtype=torch.int64)
        valid = (flat >= 0) & (flat < num_experts)
        expert = torch.where(valid, flat, torch.zeros_like(flat))
        onehot = F.one_hot(expert, num_experts) * valid.unsqueeze(1)
        rank = ((onehot.cumsum(0) - onehot) * onehot).sum(1)
        padded = (onehot.sum(0) + align - 1) // align * align
        start = padded.cumsum(0) - padded
        m_sum = (num_pairs + num_experts * (align - 1) + align - 1) // align * align
        row = torch.where(valid, start[expert] + rank, torch.full_like(flat, m_sum))

        m_indices = torch.full((m_sum + 1,), -1, dtype=torch.int32, device=device)
        m_indices[row] = torch.where(valid, expert, torch.full_like(expert, -1)).to(torch.int32)
        m_indices = m_indices[:m_sum]
        token = torch.arange(num_tokens, device=device).repeat_interleave(top_k)
        lhs = torch.zeros((m_sum + 1, hidden), dtype=torch.uint8, device=device)
        lhs[row] = xq.view(torch.uint8)[token]
        lhs = lhs[:m_sum].view(FP8_DTYPE)
        lhs_scales = torch.zeros((m_sum + 1, hidden // BLOCK), dtype=torch.float32, device=device)
        lhs_scales[row] = xs[token]
        lhs_scales = lhs_scales[:m_sum]

        h = torch.empty((m_sum, 2 * inter), dtype=torch.bfloat16, device=device)
        self._gemm((lhs, self._lhs_scales(lhs_scales, sm100)), (w1q, w1s), h, m_indices)
        act = silu_and_mul_torch(h.float())
        act = torch.where((m_indices >= 0).unsqueeze(1), act, torch.zeros_like(act))  # padding rows are unspecified
        aq, a_scales = quantize_fp8_per_token_group(act, BLOCK, power_of_two_scales=pow2)
        y = torch.empty((m_sum, hidden), dtype=torch.bfloat16, device=device)
        self._gemm((aq.contiguous(), self._lhs_scales(a_scales, sm100)), (w2q, w2s), y, m_indices)

        # Un-permute: invalid pairs read an appended zero row; weight and sum over top-k.
        y = torch.cat([y, y.new_zeros((1, hidden))])[row].float()
        pair_weights = weights.reshape(-1).to(device=device, dtype=torch.float32) * valid
        out = (y * pair_weights.unsqueeze(1)).view(num_tokens, top_k, hidden).sum(1)
        return out.to(tokens.dtype)


class DeepGemmBatchedExperts(_DeepGemmBase):
    """MASKED format on DeepGEMM's masked grouped GEMM; static shapes, no host sync."""

    activation_format = ActivationFormat.MASKED

    def __init__(
        self, power_of_two_scales: bool | None = None, *, top_k: int | None = None, num_experts: int | None = None
    ) -> None:
        super().__init__(power_of_two_scales, top_k=top_k, num_experts=num_experts)
        self._gemm = _function(self._dg, "m_grouped_fp8_gemm_nt_masked")

    def apply(self, tokens: ExpertTokens, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        num_experts, hidden, inter = _check_hidden_sizes(w1, w2)
        if tokens.hidden.dim() != 3 or tokens.hidden.shape[0] != num_experts or tokens.hidden.shape[2] != hidden:
            raise ValueError(
                f"masked activations must be [E_local={num_experts}, M, H={hidden}], got {tuple(tokens.hidden.shape)}"
            )
        m = tokens.hidden.shape[1]
        device = tokens.hidden.device
        if m == 0:
            return torch.zeros((num_experts, 0, hidden), dtype=tokens.dtype, device=device)
        pow2, sm100 = self._formats(device)
        xq, xs = _fp8_activations(tokens, pow2, sm100)
        (w1q, w1s), (w2q, w2s) = self._quantized_weights(w1, w2, pow2, sm100)
        counts = tokens.expert_num_tokens.to(device=device, dtype=torch.int32).contiguous()

        # With several groups the kernel stores each group's output in blocks of its block M
        # (64 or 128) rows, clipped only at the end of all groups: a partial last block of
        # expert g would overwrite expert g+1's first rows. Pad M to a multiple of 128.
        m_run = m
        if num_experts > 1 and m % BLOCK:
            m_run = (m + BLOCK - 1) // BLOCK * BLOCK
            xq = _pad_rows(xq.view(torch.uint8), m_run).view(FP8_DTYPE)
            xs = _pad_rows(xs, m_run)
        expected_m = expected_rows_per_expert(m, self.top_k, self.num_experts)

        valid = (torch.arange(m_run, device=device).unsqueeze(0) < counts.unsqueeze(1)).unsqueeze(-1)
        h = torch.empty((num_experts, m_run, 2 * inter), dtype=torch.bfloat16, device=device)
        self._gemm((xq, self._lhs_scales(xs, sm100)), (w1q, w1s), h, counts, expected_m)
        act = silu_and_mul_torch(h.float())
        act = torch.where(valid, act, torch.zeros_like(act))  # rows past the count are unspecified
        aq, a_scales = quantize_fp8_per_token_group(act, BLOCK, power_of_two_scales=pow2)
        y = torch.empty((num_experts, m_run, hidden), dtype=torch.bfloat16, device=device)
        self._gemm((aq.contiguous(), self._lhs_scales(a_scales, sm100)), (w2q, w2s), y, counts, expected_m)
        y = torch.where(valid, y, torch.zeros_like(y))[:, :m]
        return y.to(tokens.dtype)
