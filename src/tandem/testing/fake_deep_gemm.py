"""A CPU stand-in for DeepGEMM's grouped FP8 GEMM API (the `deep_gemm` module).

DeepGEMM (github.com/deepseek-ai/DeepGEMM) is CUDA-only and is built from its own source,
so the `deep_gemm` experts adapters are tested against this emulation instead. It keeps
the library's Python surface and data layout:

- DeepGEMM 2.6.1's names only (the removed 1.x names are absent, so code that uses them
  fails here as on the real library): the grouped GEMMs `m_grouped_fp8_gemm_nt_contiguous`
  and `m_grouped_fp8_gemm_nt_masked` (and their 2.6.1 aliases
  `m_grouped_fp8_fp4_gemm_nt_*`), keywords `a, b, d, grouped_layout | masked_m,
  expected_m` plus the recipe options, of which only the default 1x128 / 128x128 recipe
  is emulated;
- the helpers `get_mk_alignment_for_contiguous_layout`, `get_tma_aligned_size`,
  `get_mn_major_tma_aligned_tensor`, `set_num_sms` / `get_num_sms` (0 up to the device's
  SM count, taken from the CUDA device when there is one, 0 meaning all of them; every
  GEMM then needs an even count), `ceil_div`, `align`;
- the contracts the library asserts on the host, raised here as `DeepGemmContractError`
  (a `RuntimeError`, as 2.x's `DGException` reaches Python): operand dtypes (fp8 e4m3
  data, float32 scales, bf16 output, int32 layout), shapes, contiguity, scale shapes
  `[M, K/128]` and `[G, N/128, K/128]`, `expected_m > 0`, and the masked-layout rule that
  with several groups `M` is a multiple of the block M the heuristic picks (64 when
  `expected_m <= 64`, else 128): the kernel stores D with a TMA box of block M rows that is
  only clipped at `G*M`, so a partial last block of group g writes over group g+1;
- the scale-factor layouts of `transform_sf_into_required_layout` (also public): SM90 takes
  float32 scales only; on an SM100 device (`install(arch_major=10)`) the kernels read packed
  UE8M0 (int32, four exponent bytes per word, MN-major, TMA-aligned): float32 scales are
  packed on every call (weight scales broadcast per row first) and any scale that is not a
  power of two traps on the device (raised here as a `RuntimeError`), packed ones are only
  checked, and the default recipe follows the weight scales' dtype. `SF_TRANSFORMS` counts
  the transforms the library ran (and its slow torch-fallback packs), `EXPECTED_M` records
  every masked `expected_m`: tests pin what the adapters make the library do. It also checks, on the host, what the kernels silently
  assume: `K` and `N` multiples of 128 (the block size of the scaling recipe; vLLM's
  DeepGEMM path requires the same), and in the contiguous layout `M` a multiple of the
  128-row alignment with every aligned block holding one group followed only by `-1`
  padding rows.

The math is what the kernels compute: dequantize the fp8 operands with their block scales,
multiply in float32 and write bf16 into `out` in place. Rows the kernels leave unspecified
(`m_indices == -1` rows; masked rows at or past `masked_m[g]`) are written as NaN, so a
caller that reads them fails loudly instead of passing by luck. No host read of a
device value anywhere: the masked GEMM reads `masked_m` on the device, and the value checks
the real library makes on the device (the contiguous layout's group ids, SM100's UE8M0
scales) are device-side asserts (`torch._assert_async`; on CPU they raise at once).

`install()` puts this module in `sys.modules["deep_gemm"]`; `uninstall()` restores what
was there before.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import types
from typing import Iterator, Sequence

import torch

from tandem.platform.device import sm_count

__version__ = "0.0.0+tandem.fake"
#: lets callers tell the emulation from the real library.
IS_FAKE = True

FP8_DTYPE = torch.float8_e4m3fn
#: block size of the 1x128 (activation) / 128x128 (weight) scaling recipe.
BLOCK = 128
#: M-axis group alignment of the contiguous layout.
_M_ALIGNMENT = 128
#: SM count of the emulated device where there is no CUDA device to ask (an H800 / H100 SXM
#: has 132); with a CUDA device, `install()` takes the device's own count.
EMULATED_NUM_SMS = 132
DEVICE_NUM_SMS = EMULATED_NUM_SMS
#: what the kernels leave in rows they do not define.
POISON = float("nan")

#: compute capability major of the emulated device: 9 (SM90) or 10 (SM100, UE8M0 scales).
ARCH_MAJOR = 9
_DEFAULT_DEVICE = (ARCH_MAJOR, DEVICE_NUM_SMS)

_num_sms: int | None = None
#: Every `expected_m` the masked GEMM received, in call order (a record for tests; cleared
#: by `install()`): the real library only uses it to pick its block and wave heuristics.
EXPECTED_M: list[int] = []
#: Scale-factor transforms the library ran (each a kernel launch, or a slow torch copy on
#: "torch_fallback"), by operand ("lhs" / "rhs"); cleared by `install()`.
SF_TRANSFORMS: collections.Counter = collections.Counter()
_previous_module: types.ModuleType | None = None
_installed = False


class DeepGemmContractError(RuntimeError):
    """A call broke a layout/dtype/shape contract that DeepGEMM asserts or assumes."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise DeepGemmContractError(f"deep_gemm (fake): {message}")


# --------------------------------------------------------------------------- config utils


def set_num_sms(num_sms: int) -> None:
    """Cap the number of SMs the GEMM kernels may use; 0 means the whole device."""
    global _num_sms
    _require(isinstance(num_sms, int) and not isinstance(num_sms, bool), f"num_sms must be an int, got {num_sms!r}")
    _require(0 <= num_sms <= DEVICE_NUM_SMS, f"0 <= new_num_sms <= {DEVICE_NUM_SMS} (multiProcessorCount), got {num_sms}")
    _num_sms = num_sms or None


def get_num_sms() -> int:
    """The SM cap set by `set_num_sms`, else the device's SM count."""
    return DEVICE_NUM_SMS if _num_sms is None else _num_sms


def _check_num_sms() -> None:
    # Every GEMM's heuristics assert it (`heuristics/config.hpp`).
    _require(get_num_sms() % 2 == 0, f"num_sms % 2 == 0 (the GEMMs use SMs in pairs), got {get_num_sms()}")


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    return ceil_div(x, y) * y


def get_mk_alignment_for_contiguous_layout() -> int:
    """Every group's row segment in the contiguous layout starts at a multiple of this."""
    return _M_ALIGNMENT


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """`x` rounded up so that `x * element_size` bytes is a multiple of 16 (TMA rule)."""
    _require(16 % element_size == 0, f"element size {element_size} does not divide 16 bytes")
    return align(x, 16 // element_size)


def get_mn_major_tma_aligned_tensor(x: torch.Tensor) -> torch.Tensor:
    """`x [..., m, n]` (2-D or 3-D) as a column-major view whose column stride is `m`
    rounded up to 16 bytes: the layout the kernels read LHS scales in. Returns `x` itself
    when it already has that layout, else a copy."""
    _require(x.dim() in (2, 3), f"expected a 2-D or 3-D tensor, got shape {tuple(x.shape)}")
    m, n = x.shape[-2], x.shape[-1]
    col = get_tma_aligned_size(m, x.element_size())
    if x.dim() == 2:
        wanted = (1, col)
    else:
        wanted = (col * n, 1, col)
    if x.stride() == wanted:
        return x
    storage = torch.empty((*x.shape[:-2], n, col), dtype=x.dtype, device=x.device)
    view = storage.transpose(-1, -2)[..., :m, :]
    view.copy_(x)
    return view


# --------------------------------------------------------------------------- checks + math


def _unpack(pair, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    _require(
        isinstance(pair, (tuple, list)) and len(pair) == 2,
        f"{name} must be a (fp8 tensor, float32 scales) pair, got {type(pair).__name__}",
    )
    data, scales = pair
    _require(isinstance(data, torch.Tensor) and isinstance(scales, torch.Tensor), f"{name} must hold two tensors")
    return data, scales


def _check_ue8m0(scales: torch.Tensor, name: str) -> None:
    """SM100 packs float32 scales into their exponent byte and traps unless sign and
    mantissa are zero (`transpose_and_pack_fp32_into_ue8m0`)."""
    if ARCH_MAJOR != 10:
        return
    bits = scales.contiguous().view(torch.int32)
    # A device-side assert, as the real pack kernel's: no host read (on CPU it raises at once).
    torch._assert_async(
        ((bits & 0x807FFFFF) == 0).all(),
        f"deep_gemm (fake, SM100): device-side assert (values[j] & 0x807fffffu) == 0: {name} scales must be "
        "positive powers of two (UE8M0) on SM100; quantize with ceil-to-power-of-two scales",
    )


def _check_data(data: torch.Tensor, name: str) -> None:
    _require(data.dtype == FP8_DTYPE, f"{name} must be torch.float8_e4m3fn, got {data.dtype}")
    _require(data.is_contiguous(), f"{name} must be contiguous")


# --------------------------------------------------------------------------- scale-factor layouts
#
# What `csrc/apis/layout.hpp` (`transform_sf_into_required_layout`) and `csrc/utils/layout.hpp`
# (`check_sf_layout`, `get_default_recipe`) do with the scales before a GEMM:
# - SM90: float32 scales only. LHS (1x128) scales are made MN-major and TMA-aligned (a copy
#   unless they already are); weight (128x128) scales must be contiguous or
#   transposed-contiguous and are used as they are.
# - SM100: the kernels read packed UE8M0, one byte per 128 channels, four per int32,
#   MN-major and TMA-aligned (`[G, MN, ceil(K/512)]`, column stride = MN rounded up to 4).
#   float32 scales are packed on every call (weight scales broadcast to one row per N row
#   first); already-packed int32 scales are only checked. The default recipe follows the
#   weight scales: float32 -> (1, 128, 128), int32 -> (1, 1, 128). `disable_ue8m0_cast`
#   leaves float32 scales that the SM100 grouped GEMMs cannot take.


def _tma_aligned_mn(mn: int, element_size: int) -> int:
    return get_tma_aligned_size(mn, element_size)


def _check_sf_layout(
    sf: torch.Tensor, name: str, mn: int, k: int, gran_mn: int, gran_k: int, num_groups: int | None,
    *, tma_stride_check: bool = False, sm90_sfb_check: bool = False, dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if dtype is not None:
        _require(sf.dtype == dtype, f"{name} scales must be {dtype} here, got {sf.dtype}")
    _require(
        sf.dtype in (torch.float32, torch.int32),
        f"{name} scales must be torch.float32 (or, on SM100, packed UE8M0 torch.int32), got {sf.dtype}",
    )
    packed = 4 if sf.dtype == torch.int32 else 1
    shape = (*(() if num_groups is None else (num_groups,)), ceil_div(mn, gran_mn), ceil_div(k, gran_k * packed))
    _require(tuple(sf.shape) == shape, f"{name} scales must have shape {shape}, got {tuple(sf.shape)}")
    if tma_stride_check:
        column = _tma_aligned_mn(mn, sf.element_size())
        _require(
            (sf.stride(-2) == 1 or mn == 1) and sf.stride(-1) == column
            and (num_groups is None or sf.stride(-3) == sf.stride(-1) * sf.shape[-1]),
            f"{name} scales must be MN-major and TMA-aligned (strides (..., 1, {column})), got strides {sf.stride()}",
        )
    if sm90_sfb_check:
        rows, cols = sf.shape[-2], sf.shape[-1]
        _require(
            (num_groups is None or sf.stride(-3) == rows * cols)
            and ((sf.stride(-1) == 1 and sf.stride(-2) == cols) or (sf.stride(-1) == rows and sf.stride(-2) == 1)),
            f"{name} scales (SM90 weight scales) must be contiguous or contiguous after transposing the last two "
            f"dims, got strides {sf.stride()}",
        )
    return sf


def _pack_ue8m0(sf: torch.Tensor, name: str) -> torch.Tensor:
    """float32 `[..., MN, SF_K]` → packed UE8M0 int32 `[..., MN, ceil(SF_K/4)]`, MN-major and
    TMA-aligned; traps (device assert) on a scale that is not a power of two. A
    non-contiguous 3-D input takes the library's slow torch fallback."""
    _check_ue8m0(sf, name)
    contiguous = sf.is_contiguous()
    if not contiguous and (sf.dim() == 3 or sf.shape[-2] % 4):
        SF_TRANSFORMS["torch_fallback"] += 1
    batched = sf.unsqueeze(0) if sf.dim() == 2 else sf
    groups, mn, sf_k = batched.shape
    packed_k = ceil_div(sf_k, 4)
    exponents = torch.zeros((groups, mn, packed_k * 4), dtype=torch.uint8, device=sf.device)
    exponents[..., :sf_k] = (batched.contiguous().view(torch.int32) >> 23).to(torch.uint8)
    column = _tma_aligned_mn(mn, 4)
    out = torch.empty_strided((groups, mn, packed_k), (packed_k * column, 1, column), dtype=torch.int32, device=sf.device)
    out.copy_(exponents.view(torch.int32))
    return out.squeeze(0) if sf.dim() == 2 else out


def _unpack_ue8m0(packed: torch.Tensor, sf_k: int) -> torch.Tensor:
    """Packed UE8M0 int32 `[..., MN, ceil(SF_K/4)]` → float32 powers of two `[..., MN, SF_K]`."""
    dense = torch.empty(packed.shape, dtype=torch.int32, device=packed.device).copy_(packed)  # row-major strides
    exponents = dense.view(torch.uint8)[..., :sf_k].to(torch.int32)
    return (exponents << 23).view(torch.float32)


def _transform_sf(
    sf: torch.Tensor, name: str, mn: int, k: int, recipe: tuple, num_groups: int | None, is_sfa: bool | None,
    disable_ue8m0_cast: bool,
) -> torch.Tensor:
    if len(recipe) == 3:
        _require(is_sfa is not None, "a 3-element recipe needs is_sfa")
        gran_mn, gran_k = (recipe[0] if is_sfa else recipe[1]), recipe[2]
    else:
        _require(is_sfa is None, "a 2-element recipe takes no is_sfa")
        gran_mn, gran_k = recipe
    _require(gran_k == BLOCK and gran_mn in (1, BLOCK), f"only 1x128 / 128x128 scale blocks are emulated, got {recipe}")
    _check_sf_layout(sf, name, mn, k, gran_mn, gran_k, num_groups)
    sm90_rules = ARCH_MAJOR == 9 or disable_ue8m0_cast
    if sf.dtype == torch.float32 and sm90_rules:
        if gran_mn == 1:
            aligned = get_mn_major_tma_aligned_tensor(sf)
            if aligned is not sf:
                SF_TRANSFORMS[name] += 1
            return aligned
        return _check_sf_layout(sf, name, mn, k, gran_mn, gran_k, num_groups, sm90_sfb_check=True)
    if sf.dtype == torch.float32 and ARCH_MAJOR == 10:
        SF_TRANSFORMS[name] += 1
        broadcast = sf if gran_mn == 1 else sf.repeat_interleave(gran_mn, dim=-2)[..., :mn, :]
        return _pack_ue8m0(broadcast, name)
    if sf.dtype == torch.int32 and gran_mn == 1 and ARCH_MAJOR == 10:
        return _check_sf_layout(sf, name, mn, k, gran_mn, gran_k, num_groups, tma_stride_check=True)
    raise DeepGemmContractError(
        f"deep_gemm (fake): Unknown SF transformation ({name} scales {sf.dtype}, recipe {recipe}, sm_{ARCH_MAJOR}0"
        f"{', disable_ue8m0_cast' if disable_ue8m0_cast else ''}): packed int32 UE8M0 scales are SM100-only"
    )


def transform_sf_into_required_layout(
    sf: torch.Tensor,
    mn: int,
    k: int,
    recipe: Sequence[int],
    num_groups: int | None = None,
    is_sfa: bool | None = None,
    disable_ue8m0_cast: bool = False,
) -> torch.Tensor:
    """Scales in the layout this device's GEMMs read (see the notes above): what the GEMMs
    do to their scale arguments on every call, done once ahead of time (DeepGEMM 2.6.1)."""
    name = "sf" if is_sfa is None else ("lhs" if is_sfa else "rhs")
    return _transform_sf(sf, name, mn, k, tuple(recipe), num_groups, is_sfa, disable_ue8m0_cast)


def _transform_pair(a_scales, b_scales, m, n, k, num_groups_a, num_groups_b, recipe, recipe_a, recipe_b, disable_ue8m0_cast):
    """`transform_sf_pair_into_required_layout`: the default recipe, then each side."""
    if recipe_a is None and recipe is None:
        if ARCH_MAJOR == 9:
            _require(
                a_scales.dtype == torch.float32 and b_scales.dtype == torch.float32,
                f"SM90 takes float32 scales only (get_default_recipe), got lhs {a_scales.dtype}, rhs {b_scales.dtype}",
            )
            recipe = (1, BLOCK, BLOCK)
        else:
            _require(b_scales.dtype in (torch.float32, torch.int32), f"rhs scales must be float32 or int32, got {b_scales.dtype}")
            recipe = (1, BLOCK, BLOCK) if b_scales.dtype == torch.float32 else (1, 1, BLOCK)
    _require((recipe_a is None) == (recipe_b is None), "recipe_a and recipe_b go together")
    _require((recipe_a is None) != (recipe is None), "give either recipe or recipe_a + recipe_b")
    if recipe is not None:
        sfa = _transform_sf(a_scales, "lhs", m, k, tuple(recipe), num_groups_a, True, disable_ue8m0_cast)
        sfb = _transform_sf(b_scales, "rhs", n, k, tuple(recipe), num_groups_b, False, disable_ue8m0_cast)
    else:
        sfa = _transform_sf(a_scales, "lhs", m, k, tuple(recipe_a), num_groups_a, None, disable_ue8m0_cast)
        sfb = _transform_sf(b_scales, "rhs", n, k, tuple(recipe_b), num_groups_b, None, disable_ue8m0_cast)
    _require(
        (ARCH_MAJOR == 9 and sfa.dtype == torch.float32) or (ARCH_MAJOR == 10 and sfa.dtype == torch.int32),
        "Unsupported architecture or scaling factor types (SM100's grouped GEMMs need UE8M0 scales: "
        "disable_ue8m0_cast=True is for SM90 layouts)",
    )
    return sfa, sfb


def _check_nk(n: int, k: int) -> None:
    _require(n > 0 and k > 0, f"N and K must be positive, got N={n}, K={k}")
    _require(k % BLOCK == 0, f"K={k} must be a multiple of {BLOCK} (the scaling block)")
    _require(n % BLOCK == 0, f"N={n} must be a multiple of {BLOCK} (the scaling block)")


def _dequantize_lhs(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`[..., M, K]` fp8 with 1x128 scales (float32 `[..., M, K/128]` or packed UE8M0) → float32."""
    sf_k = data.shape[-1] // BLOCK
    if scales.dtype == torch.int32:
        scales = _unpack_ue8m0(scales, sf_k)
    groups = data.float().unflatten(-1, (sf_k, BLOCK))
    return (groups * scales.float().unsqueeze(-1)).flatten(-2)


def _dequantize_rhs(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`[G, N, K]` fp8 with 128x128 float32 scales `[G, N/128, K/128]`, or packed UE8M0 with
    one row per N row (`[G, N, ceil(K/512)]`) → float32."""
    if scales.dtype == torch.int32:
        rows = _unpack_ue8m0(scales, data.shape[-1] // BLOCK)
        return data.float() * rows.repeat_interleave(BLOCK, dim=2)
    full = scales.float().repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    return data.float() * full


def _check_recipe(recipe, recipe_a, recipe_b) -> None:
    """The emulated recipes: 1x128 LHS blocks with 128x128 weight blocks (float32 weight
    scales) or, on SM100, 1x128 weight rows (packed UE8M0 weight scales)."""
    _require(
        recipe is None or tuple(recipe) in ((1, BLOCK, BLOCK), (1, 1, BLOCK)),
        f"only the (1, 128, 128) and (1, 1, 128) recipes are emulated, got recipe={recipe!r}",
    )
    _require(recipe_a is None or tuple(recipe_a) == (1, BLOCK), f"only recipe_a=(1, 128) is emulated, got {recipe_a!r}")
    _require(
        recipe_b is None or tuple(recipe_b) in ((BLOCK, BLOCK), (1, BLOCK)),
        f"only recipe_b=(128, 128) or (1, 128) is emulated, got {recipe_b!r}",
    )


def _check_contiguous_layout(m_indices: torch.Tensor, num_groups: int) -> None:
    """Values of `m_indices`: in [-1, G), and each aligned block of rows is one group
    followed only by -1 padding (or all -1)."""
    alignment = get_mk_alignment_for_contiguous_layout()
    m = m_indices.numel()
    _require(
        m % alignment == 0,
        f"M={m} must be a multiple of the contiguous-layout alignment {alignment}: "
        "pad each group's rows up to the alignment and mark the padding rows with -1",
    )
    values = m_indices.to(torch.int64)
    # Checked on the device (no host read of the layout): on CPU the assert raises at once.
    torch._assert_async(
        ((values >= -1) & (values < num_groups)).all(), f"m_indices values must lie in [-1, {num_groups})"
    )
    blocks = values.view(-1, alignment)
    valid = blocks >= 0
    same_group = (blocks == blocks[:, :1]) | ~valid
    valid_is_prefix = (valid[:, 1:] <= valid[:, :-1]).all(dim=1)
    good = same_group.all(dim=1) & valid_is_prefix
    torch._assert_async(
        good.all(),
        f"an aligned block of m_indices rows: rows mix groups or put -1 padding before valid rows: every group's "
        f"segment must start at a multiple of {alignment} (get_mk_alignment_for_contiguous_layout()), padded at "
        "its tail with -1",
    )


def _contiguous_impl(a, b, d, m_indices, *, api: str, scale_options: dict) -> None:
    _check_num_sms()
    lhs, lhs_scales = _unpack(a, "lhs")
    rhs, rhs_scales = _unpack(b, "rhs")
    _require(
        isinstance(d, torch.Tensor) and isinstance(m_indices, torch.Tensor), f"{api}: out and m_indices must be tensors"
    )
    _require(lhs.dim() == 2, f"lhs must be [M, K], got shape {tuple(lhs.shape)}")
    _require(rhs.dim() == 3, f"rhs must be [G, N, K], got shape {tuple(rhs.shape)}")
    _require(d.dim() == 2, f"out must be [M, N], got shape {tuple(d.shape)}")
    m, k = lhs.shape
    num_groups, n, k_ = rhs.shape
    _require(
        (m, n, k) == (d.shape[0], d.shape[1], k_) and m_indices.dim() == 1 and m_indices.numel() == m,
        f"shape mismatch: lhs {tuple(lhs.shape)}, rhs {tuple(rhs.shape)}, out {tuple(d.shape)}, "
        f"m_indices {tuple(m_indices.shape)}",
    )
    _require(num_groups > 0, "rhs must hold at least one group")
    _check_nk(n, k)
    _check_data(lhs, "lhs")
    _check_data(rhs, "rhs")
    _require(d.dtype == torch.bfloat16, f"out must be torch.bfloat16, got {d.dtype}")
    _require(m_indices.dtype == torch.int32, f"m_indices must be torch.int32, got {m_indices.dtype}")
    _require(d.is_contiguous() and m_indices.is_contiguous(), "out and m_indices must be contiguous")
    if m == 0:
        return
    lhs_scales, rhs_scales = _transform_pair(lhs_scales, rhs_scales, m, n, k, None, num_groups, **scale_options)
    _check_contiguous_layout(m_indices, num_groups)

    alignment = get_mk_alignment_for_contiguous_layout()
    block_group = m_indices.view(-1, alignment)[:, 0].to(torch.int64)
    live = (block_group >= 0).nonzero().flatten()  # all--1 blocks are skipped, as the kernel does
    result = torch.full((m // alignment, alignment, n), POISON, dtype=torch.float32, device=d.device)
    if live.numel():
        x = _dequantize_lhs(lhs, lhs_scales).view(-1, alignment, k)[live]
        w = _dequantize_rhs(rhs, rhs_scales)[block_group[live]]
        result[live] = torch.bmm(x, w.transpose(1, 2))
    result = result.view(m, n)
    result = torch.where((m_indices >= 0).unsqueeze(1), result, torch.full_like(result, POISON))
    d.copy_(result.to(torch.bfloat16))


def _masked_impl(a, b, d, masked_m, expected_m, *, api: str, scale_options: dict) -> None:
    _check_num_sms()
    lhs, lhs_scales = _unpack(a, "lhs")
    rhs, rhs_scales = _unpack(b, "rhs")
    _require(
        isinstance(d, torch.Tensor) and isinstance(masked_m, torch.Tensor), f"{api}: out and masked_m must be tensors"
    )
    _require(lhs.dim() == 3, f"lhs must be [G, M, K], got shape {tuple(lhs.shape)}")
    _require(rhs.dim() == 3, f"rhs must be [G, N, K], got shape {tuple(rhs.shape)}")
    _require(d.dim() == 3, f"out must be [G, M, N], got shape {tuple(d.shape)}")
    num_groups, m, k = lhs.shape
    _, n, _ = rhs.shape
    _require(
        tuple(rhs.shape) == (num_groups, n, k)
        and tuple(d.shape) == (num_groups, m, n)
        and masked_m.numel() == num_groups,
        f"shape mismatch: lhs {tuple(lhs.shape)}, rhs {tuple(rhs.shape)}, out {tuple(d.shape)}, "
        f"masked_m {tuple(masked_m.shape)}",
    )
    _require(
        isinstance(expected_m, int) and not isinstance(expected_m, bool),
        f"expected_m is a host-side int hint, got {type(expected_m).__name__}",
    )
    _require(
        expected_m > 0 and m > 0 and num_groups > 0,
        f"expected_m, M and G must be positive, got expected_m={expected_m}, M={m}, G={num_groups}",
    )
    _check_nk(n, k)
    _check_data(lhs, "lhs")
    _check_data(rhs, "rhs")
    _require(d.dtype == torch.bfloat16, f"out must be torch.bfloat16, got {d.dtype}")
    _require(masked_m.dtype == torch.int32, f"masked_m must be torch.int32, got {masked_m.dtype}")
    _require(d.is_contiguous() and masked_m.is_contiguous(), "out and masked_m must be contiguous")
    lhs_scales, rhs_scales = _transform_pair(lhs_scales, rhs_scales, m, n, k, num_groups, num_groups, **scale_options)
    EXPECTED_M.append(expected_m)
    block_m = 64 if expected_m <= 64 else 128
    _require(
        num_groups == 1 or m % block_m == 0,
        f"with several groups M={m} must be a multiple of the block M ({block_m} for expected_m={expected_m}): "
        "the output store is not clipped per group",
    )

    x = _dequantize_lhs(lhs, lhs_scales)
    w = _dequantize_rhs(rhs, rhs_scales)
    result = torch.bmm(x, w.transpose(1, 2))
    rows = torch.arange(m, device=d.device)
    valid = rows.unsqueeze(0) < masked_m.to(device=d.device, dtype=torch.int64).unsqueeze(1)
    result = torch.where(valid.unsqueeze(-1), result, torch.full_like(result, POISON))
    d.copy_(result.to(torch.bfloat16))


# --------------------------------------------------------------------------- public GEMMs


def m_grouped_fp8_gemm_nt_contiguous(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    d: torch.Tensor,
    grouped_layout: torch.Tensor,
    recipe: Sequence[int] | None = None,
    recipe_a: Sequence[int] | None = None,
    recipe_b: Sequence[int] | None = None,
    compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False,
    use_psum_layout: bool = False,
    ensure_zero_padding: bool = True,
    expected_m_for_psum_layout: int | None = None,
) -> None:
    """DeepGEMM 2.x name of the contiguous grouped GEMM (`grouped_layout` = `m_indices`).

    Emulates the SM90 path: float32 scales with the default 1x128 / 128x128 recipe. The
    prefix-sum layout (`use_psum_layout=True`) is not emulated.
    """
    _check_recipe(recipe, recipe_a, recipe_b)
    scale_options = dict(recipe=recipe, recipe_a=recipe_a, recipe_b=recipe_b, disable_ue8m0_cast=disable_ue8m0_cast)
    if use_psum_layout:
        raise NotImplementedError("deep_gemm (fake): use_psum_layout=True is not emulated; pass per-row m_indices")
    _require(expected_m_for_psum_layout is None, "expected_m_for_psum_layout needs use_psum_layout=True")
    _contiguous_impl(a, b, d, grouped_layout, api="m_grouped_fp8_gemm_nt_contiguous", scale_options=scale_options)


def m_grouped_fp8_gemm_nt_masked(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    d: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    recipe: Sequence[int] | None = None,
    recipe_a: Sequence[int] | None = None,
    recipe_b: Sequence[int] | None = None,
    compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False,
) -> None:
    """DeepGEMM 2.x name of the masked grouped GEMM (default 1x128 / 128x128 recipe)."""
    _check_recipe(recipe, recipe_a, recipe_b)
    scale_options = dict(recipe=recipe, recipe_a=recipe_a, recipe_b=recipe_b, disable_ue8m0_cast=disable_ue8m0_cast)
    _masked_impl(a, b, d, masked_m, expected_m, api="m_grouped_fp8_gemm_nt_masked", scale_options=scale_options)


#: In 2.6.1 the fp8 names are aliases of the fp8/fp4 GEMMs (fp4 operands are not emulated).
m_grouped_fp8_fp4_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
m_grouped_fp8_fp4_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked


# --------------------------------------------------------------------------- install


def _device_sm_count() -> int:
    return sm_count() or EMULATED_NUM_SMS


def install(*, arch_major: int = 9, device_num_sms: int | None = None) -> types.ModuleType:
    """Make `import deep_gemm` return this emulation (state reset) of a device with
    compute capability `arch_major` (9: SM90, 10: SM100) and `device_num_sms` SMs;
    returns the module."""
    global _previous_module, _installed, _num_sms, ARCH_MAJOR, DEVICE_NUM_SMS
    if arch_major not in (9, 10):
        raise ValueError(f"the emulated device is SM90 or SM100 (arch_major 9 or 10), got {arch_major}")
    ARCH_MAJOR, DEVICE_NUM_SMS = arch_major, device_num_sms if device_num_sms is not None else _device_sm_count()
    module = sys.modules[__name__]
    if not _installed:
        _previous_module = sys.modules.get("deep_gemm")
        _installed = True
    sys.modules["deep_gemm"] = module
    _num_sms = None
    EXPECTED_M.clear()
    SF_TRANSFORMS.clear()
    return module


def uninstall() -> None:
    """Undo `install()`: restore whatever `sys.modules["deep_gemm"]` held before."""
    global _previous_module, _installed, ARCH_MAJOR, DEVICE_NUM_SMS
    ARCH_MAJOR, DEVICE_NUM_SMS = _DEFAULT_DEVICE
    if not _installed:
        return
    if sys.modules.get("deep_gemm") is sys.modules[__name__]:
        if _previous_module is None:
            del sys.modules["deep_gemm"]
        else:
            sys.modules["deep_gemm"] = _previous_module
    _previous_module = None
    _installed = False


@contextlib.contextmanager
def installed(*, arch_major: int = 9, device_num_sms: int | None = None) -> Iterator[types.ModuleType]:
    """`with installed() as deep_gemm: ...`"""
    module = install(arch_major=arch_major, device_num_sms=device_num_sms)
    try:
        yield module
    finally:
        uninstall()
