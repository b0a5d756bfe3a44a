"""DeepGEMM experts adapters against the torch oracles, on the CPU emulation of `deep_gemm`.

Inputs are built fp8-exact (activations per token 1x128, weights per 128x128 block, each
group's scale a power of two, so bf16 holds them exactly too): quantizing them inside the
adapters is lossless and the oracles see the very values the GEMMs see. Two references:

- `_pipeline_reference`: a per-token loop that follows DeepGEMM's recipe step by step (bf16
  GEMM outputs, the SiLU-and-mul output requantized to fp8 before the second GEMM). The
  adapters must match it to bf16 precision.
- `TorchExperts` / `TorchBatchedExperts` / `torch_moe_reference` (no intermediate
  quantization): they differ from DeepGEMM's pipeline by the one fp8 requantization of the
  intermediate activation, a 2-3 % relative error, hence `FP8_REL_TOL`.
"""

from __future__ import annotations

import gc
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from tandem.modular_kernels import (
    ActivationFormat,
    ExpertTokens,
    MOE_BACKENDS,
    TorchBatchedExperts,
    TorchExperts,
    build_moe_kernel,
    select_experts,
    torch_moe_reference,
)
from tandem.modular_kernels import MoEConfig, experts_deep_gemm
from tandem.modular_kernels.experts_deep_gemm import DeepGemmBatchedExperts, DeepGemmExperts
from tandem.modular_kernels.factory import experts_class
from tandem.testing import fake_deep_gemm
from tests.support.moe_cases import failing_import

E, H, I, TOP_K, NUM_TOKENS = 4, 128, 128, 2, 16
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
#: bf16-level agreement with the step-by-step reference (relative Frobenius error; the
#: bf16 rounding of the output alone is up to 2**-9 per element, measured ~1.8e-3).
TIGHT_REL_TOL = 5e-3
#: agreement with the unquantized-intermediate oracles: one extra e4m3 rounding (3 mantissa
#: bits, RMS ~3.6 % per element) of the SiLU-and-mul output, measured 2.2-2.6 %.
FP8_REL_TOL = 5e-2
#: random (not fp8-exact) weights and activations against the float32 oracle: every operand
#: is rounded to fp8 too (tests/modular_kernels/test_backend_matrix.py's deep_gemm tolerance).
ORACLE_REL_TOL = 8e-2


@pytest.fixture
def deep_gemm():
    module = fake_deep_gemm.install()
    yield module
    fake_deep_gemm.uninstall()
    assert sys.modules.get("deep_gemm") is not module


# ----------------------------------------------------------------------------- helpers


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()


def _quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1x128 fp8 quantization, written independently of the package's."""
    groups = x.float().unflatten(-1, (x.shape[-1] // 128, 128))
    scales = groups.abs().amax(-1).clamp(min=1e-10) / FP8_MAX
    q = (groups / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-2), scales


def _dequant_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (q.float().unflatten(-1, (scales.shape[-1], 128)) * scales.unsqueeze(-1)).flatten(-2)


def _roundtrip_rows(x: torch.Tensor) -> torch.Tensor:
    return _dequant_rows(*_quant_rows(x))


def _roundtrip_blocks(w: torch.Tensor) -> torch.Tensor:
    """128x128 block fp8 roundtrip of `[E, N, K]`, one tile at a time."""
    out = torch.empty_like(w, dtype=torch.float32)
    for e in range(w.shape[0]):
        for n0 in range(0, w.shape[1], 128):
            for k0 in range(0, w.shape[2], 128):
                tile = w[e, n0 : n0 + 128, k0 : k0 + 128].float()
                scale = tile.abs().amax().clamp(min=1e-10) / FP8_MAX
                out[e, n0 : n0 + 128, k0 : k0 + 128] = (tile / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
    return out


def _fp8_grid(shape, generator) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * 96).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()


def _pow2(shape, generator) -> torch.Tensor:
    return torch.pow(2.0, torch.randint(-10, -5, shape, generator=generator).float())


def _activations(shape, seed: int) -> torch.Tensor:
    """Random activations that per-token 1x128 fp8 quantization reproduces bit for bit and
    bf16 holds exactly: each 128-group is fp8 grid values with its first element at +-448,
    times a power of two (which is then exactly the group's scale)."""
    g = torch.Generator().manual_seed(seed)
    groups = _fp8_grid(shape, g).unflatten(-1, (shape[-1] // 128, 128))
    groups[..., 0] = torch.where(groups[..., 0] < 0, -FP8_MAX, FP8_MAX)
    return (groups * _pow2(groups.shape[:-1], g).unsqueeze(-1)).flatten(-2)


def _weights(seed: int = 0, hidden: int = H, inter: int = I) -> tuple[torch.Tensor, torch.Tensor]:
    """`w1 [E, 2I, H]`, `w2 [E, H, I]` that 128x128 block fp8 quantization reproduces bit for
    bit (each tile: fp8 grid values, its first element at +-448, times a power of two)."""
    g = torch.Generator().manual_seed(seed)

    def make(e, n, k):
        tiles = _fp8_grid((e, n // 128, 128, k // 128, 128), g)
        tiles[:, :, 0, :, 0] = torch.where(tiles[:, :, 0, :, 0] < 0, -FP8_MAX, FP8_MAX)
        tiles = tiles * _pow2((e, n // 128, 1, k // 128, 1), g)
        return tiles.reshape(e, n, k)

    return make(E, 2 * inter, hidden), make(E, hidden, inter)


def _expert_reference(x: torch.Tensor, w1e: torch.Tensor, w2e: torch.Tensor) -> torch.Tensor:
    """One expert on rows `x` the way DeepGEMM's pipeline computes it."""
    h = (x.float() @ w1e.float().t()).to(torch.bfloat16).float()
    gate, up = h.chunk(2, dim=-1)
    act = _roundtrip_rows(F.silu(gate) * up)
    return (act @ w2e.float().t()).to(torch.bfloat16).float()


def _pipeline_reference(x, w1, w2, topk_weights, topk_ids) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if 0 <= e < w1.shape[0]:
                out[t] += float(topk_weights[t, k]) * _expert_reference(x[t : t + 1], w1[e], w2[e])[0]
    return out


def _routing(kind: str, num_tokens: int = NUM_TOKENS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(num_tokens, TOP_K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(num_tokens)])
    if kind == "all_to_one":
        ids = torch.full((num_tokens, TOP_K), 2)
        ids[:, 1] = -1  # top-k of one expert: the second slot lives elsewhere
    elif kind == "zero_token_expert":  # expert 1 gets nothing
        others = torch.tensor([0, 2, 3])
        ids = torch.stack([others[torch.randperm(3, generator=g)[:TOP_K]] for _ in range(num_tokens)])
    elif kind == "minus_one":
        drop = torch.rand(num_tokens, TOP_K, generator=g) < 0.4
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
        ids[0] = -1  # a token with nothing on this rank
    else:
        assert kind == "random"
    return ids, weights


def _standard_tokens(fp8_input: bool, num_tokens: int = NUM_TOKENS, routing: str = "random", seed: int = 0):
    x_rt = _activations((num_tokens, H), seed + 100).to(torch.bfloat16)  # fp8- and bf16-exact
    q, s = _quant_rows(x_rt)
    ids, weights = _routing(routing, num_tokens, seed)
    if fp8_input:
        tokens = ExpertTokens(q, s, torch.bfloat16, topk_ids=ids, topk_weights=weights)
    else:
        tokens = ExpertTokens(x_rt, None, torch.bfloat16, topk_ids=ids, topk_weights=weights)
    return tokens, x_rt, ids, weights


# ----------------------------------------------------------------------------- STANDARD adapter


@pytest.mark.parametrize("fp8_input", [True, False], ids=["fp8_dispatch", "bf16_dispatch"])
@pytest.mark.parametrize("routing", ["random", "all_to_one", "zero_token_expert", "minus_one"])
def test_standard_matches_oracles(deep_gemm, routing, fp8_input):
    w1, w2 = _weights()
    tokens, x_rt, ids, weights = _standard_tokens(fp8_input, routing=routing)
    out = DeepGemmExperts().apply(tokens, w1, w2)

    assert out.shape == (NUM_TOKENS, H) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    tight = _pipeline_reference(x_rt, w1, w2, weights, ids)
    assert _rel_err(out, tight) < TIGHT_REL_TOL
    torch.testing.assert_close(out.float(), tight, rtol=2e-2, atol=2e-2 * tight.abs().max().item())
    oracle = TorchExperts().apply(tokens, w1, w2)
    assert _rel_err(out, oracle) < FP8_REL_TOL
    # tokens whose every slot is -1 (or elsewhere) get exactly zero
    nothing_here = (ids < 0).all(dim=1)
    assert (out[nothing_here] == 0).all()


def test_standard_handles_no_tokens(deep_gemm):
    w1, w2 = _weights()
    tokens = ExpertTokens(
        torch.zeros(0, H, dtype=torch.bfloat16),
        None,
        torch.bfloat16,
        topk_ids=torch.zeros(0, TOP_K, dtype=torch.int64),
        topk_weights=torch.zeros(0, TOP_K),
    )
    out = DeepGemmExperts().apply(tokens, w1, w2)
    assert out.shape == (0, H) and out.dtype == torch.bfloat16


def test_standard_every_id_elsewhere_gives_zeros(deep_gemm):
    w1, w2 = _weights()
    tokens, *_ = _standard_tokens(True, num_tokens=4)
    tokens.topk_ids = torch.full((4, TOP_K), -1)
    assert (DeepGemmExperts().apply(tokens, w1, w2) == 0).all()


# ----------------------------------------------------------------------------- MASKED adapter


@pytest.mark.parametrize("fp8_input", [True, False], ids=["fp8_dispatch", "bf16_dispatch"])
@pytest.mark.parametrize("max_tokens", [16, 200], ids=["M16", "M200_padded"])
def test_batched_matches_oracles(deep_gemm, max_tokens, fp8_input):
    w1, w2 = _weights(seed=1)
    counts = torch.tensor([5, 0, max_tokens, 1])
    x = _activations((E, max_tokens, H), seed=7)
    rows = torch.arange(max_tokens)
    x = torch.where((rows.unsqueeze(0) < counts.unsqueeze(1)).unsqueeze(-1), x, x * 1000)  # rows past the count: junk
    x_rt = x.to(torch.bfloat16)
    q, s = _quant_rows(x_rt)
    if fp8_input:
        tokens = ExpertTokens(q, s, torch.bfloat16, expert_num_tokens=counts)
    else:
        tokens = ExpertTokens(x_rt, None, torch.bfloat16, expert_num_tokens=counts)

    out = DeepGemmBatchedExperts().apply(tokens, w1, w2)

    assert out.shape == (E, max_tokens, H) and out.dtype == torch.bfloat16
    for e in range(E):
        n = int(counts[e])
        assert (out[e, n:] == 0).all(), f"expert {e}: rows past its count must be zero"
        if n:
            tight = _expert_reference(x_rt[e, :n], w1[e], w2[e])
            assert _rel_err(out[e, :n], tight) < TIGHT_REL_TOL
    oracle = TorchBatchedExperts().apply(ExpertTokens(x_rt, None, torch.bfloat16, expert_num_tokens=counts), w1, w2)
    assert _rel_err(out, oracle) < FP8_REL_TOL


def test_batched_counts_may_be_int32_or_int64(deep_gemm):
    w1, w2 = _weights()
    x = _activations((E, 8, H), seed=5).to(torch.bfloat16)
    outs = [
        DeepGemmBatchedExperts().apply(
            ExpertTokens(x, None, torch.bfloat16, expert_num_tokens=torch.tensor([8, 3, 0, 1], dtype=dtype)), w1, w2
        )
        for dtype in (torch.int32, torch.int64)
    ]
    assert torch.equal(outs[0], outs[1])


# ----------------------------------------------------------------------------- shared adapter rules


@pytest.mark.parametrize("cls", [DeepGemmExperts, DeepGemmBatchedExperts])
@pytest.mark.parametrize("hidden,inter", [(64, 128), (128, 64), (192, 128)])
def test_hidden_and_intermediate_must_be_multiples_of_128(deep_gemm, cls, hidden, inter):
    w1 = torch.randn(E, 2 * inter, hidden)
    w2 = torch.randn(E, hidden, inter)
    if cls is DeepGemmExperts:
        tokens = ExpertTokens(
            torch.randn(4, hidden), None, torch.float32, topk_ids=torch.zeros(4, 1, dtype=torch.int64),
            topk_weights=torch.ones(4, 1),
        )
    else:
        tokens = ExpertTokens(torch.randn(E, 4, hidden), None, torch.float32, expert_num_tokens=torch.ones(E))
    with pytest.raises(ValueError, match="multiples of 128"):
        cls().apply(tokens, w1, w2)


def test_weights_are_quantized_once_per_tensor_version(deep_gemm, monkeypatch):
    calls = []
    real = experts_deep_gemm.quantize_fp8_per_block

    def counting(w, *args, **kwargs):
        calls.append(tuple(w.shape))
        return real(w, *args, **kwargs)

    monkeypatch.setattr(experts_deep_gemm, "quantize_fp8_per_block", counting)
    w1, w2 = _weights()
    tokens, x_rt, ids, weights = _standard_tokens(True)
    experts = DeepGemmExperts()

    first = experts.apply(tokens, w1, w2)
    second = experts.apply(tokens, w1, w2)
    assert len(calls) == 2 and torch.equal(first, second)

    w1.mul_(0.5)  # in place: the version counter moves, the cache must notice
    third = experts.apply(tokens, w1, w2)
    assert len(calls) == 3
    assert _rel_err(third, _pipeline_reference(x_rt, w1, w2, weights, ids)) < TIGHT_REL_TOL

    other = w2.clone()
    experts.apply(tokens, w1, other)
    assert len(calls) == 4 and len(experts._weights) == 3
    del other
    gc.collect()
    assert len(experts._weights) == 2  # a freed weight's entry goes with it


def test_block_quantization_matches_an_independent_roundtrip():
    w = torch.randn(2, 256, 384, generator=torch.Generator().manual_seed(4))
    q, s = experts_deep_gemm.quantize_fp8_per_block(w)
    assert q.dtype == FP8 and q.shape == w.shape and s.shape == (2, 2, 3) and s.dtype == torch.float32
    torch.testing.assert_close(_dequant_blocks(q, s), _roundtrip_blocks(w), rtol=0, atol=0)
    exact, _ = _weights()
    q, s = experts_deep_gemm.quantize_fp8_per_block(exact)
    assert torch.equal(_dequant_blocks(q, s), exact)  # the test weights are fp8-exact


# ----------------------------------------------------------------------------- factory


@pytest.mark.parametrize("use_fp8_dispatch", [False, True])
def test_build_moe_kernel_local_deep_gemm_end_to_end(deep_gemm, use_fp8_dispatch):
    kernel = build_moe_kernel(
        "local", "deep_gemm", num_experts=E, top_k=TOP_K, hidden_size=H, use_fp8_dispatch=use_fp8_dispatch
    )
    assert isinstance(kernel.experts, DeepGemmExperts) and kernel.experts.name == "deep_gemm"
    w1, w2 = _weights(seed=3)
    g = torch.Generator().manual_seed(11)
    hidden = _activations((NUM_TOKENS, H), seed=12).to(torch.bfloat16)
    topk_weights, topk_ids = select_experts(torch.randn(NUM_TOKENS, E, generator=g), TOP_K, renormalize=True)

    out = kernel.forward(hidden, w1, w2, topk_weights, topk_ids)

    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    assert _rel_err(out, _pipeline_reference(hidden, w1, w2, topk_weights, topk_ids)) < TIGHT_REL_TOL
    assert _rel_err(out, torch_moe_reference(hidden, w1, w2, topk_weights, topk_ids)) < FP8_REL_TOL


def test_factory_registers_both_formats(deep_gemm):
    assert set(MOE_BACKENDS["deep_gemm"]) == {ActivationFormat.STANDARD, ActivationFormat.MASKED}
    config = MoEConfig(moe_backend="deep_gemm")
    standard = experts_class("deep_gemm", ActivationFormat.STANDARD).from_moe_config(config, num_experts=E, top_k=TOP_K)
    masked = experts_class("deep_gemm", ActivationFormat.MASKED).from_moe_config(config, num_experts=E, top_k=TOP_K)
    assert type(standard) is DeepGemmExperts and standard.activation_format is ActivationFormat.STANDARD
    assert type(masked) is DeepGemmBatchedExperts and masked.activation_format is ActivationFormat.MASKED


def test_missing_deep_gemm_gives_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # `import deep_gemm` fails even if installed
    for make in (DeepGemmExperts, DeepGemmBatchedExperts):
        with pytest.raises(ImportError, match=r"tandem\[gpu\].*from its own source") as info:
            make()
        assert "DeepGEMM" in str(info.value) and "README" in str(info.value)
    with pytest.raises(ImportError, match="DeepGEMM"):
        build_moe_kernel("local", "deep_gemm", num_experts=E, top_k=TOP_K, hidden_size=H)


# ----------------------------------------------------------------------------- the emulation itself


def _contiguous_problem(sizes=(3, 0, 130, 1), n=256, k=128, seed=0):
    """A valid contiguous-layout call: group g has sizes[g] rows, segments padded to 128."""
    g = torch.Generator().manual_seed(seed)
    segments = [(s + 127) // 128 * 128 for s in sizes]
    m = sum(segments)
    m_indices = torch.full((m,), -1, dtype=torch.int32)
    start = 0
    for group, (size, seg) in enumerate(zip(sizes, segments)):
        m_indices[start : start + size] = group
        start += seg
    a_q, a_s = _quant_rows(torch.randn(m, k, generator=g))
    b = torch.randn(len(sizes), n, k, generator=g)
    b_q, b_s = experts_deep_gemm.quantize_fp8_per_block(b)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    return dict(a=(a_q, a_s), b=(b_q, b_s), d=d, layout=m_indices)


def _dequant_blocks(q, s):
    return q.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)


def test_fake_contiguous_math_and_padding_rows(deep_gemm):
    p = _contiguous_problem()
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(p["a"], p["b"], p["d"], p["layout"])
    a = _dequant_rows(*p["a"])
    b = _dequant_blocks(*p["b"])
    valid = p["layout"] >= 0
    rows = valid.nonzero().flatten()
    expected = torch.stack([a[r] @ b[int(p["layout"][r])].t() for r in rows])
    torch.testing.assert_close(p["d"][rows].float(), expected, rtol=1e-2, atol=1e-2)
    assert torch.isnan(p["d"][~valid].float()).all()  # padding rows are unspecified: poisoned


def test_fake_contiguous_accepts_tma_aligned_scales(deep_gemm):
    p = _contiguous_problem()
    q, s = p["a"]
    aligned = deep_gemm.get_mn_major_tma_aligned_tensor(s)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((q, aligned), p["b"], p["d"], p["layout"])
    ref = torch.empty_like(p["d"])
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((q, s), p["b"], ref, p["layout"])
    assert torch.equal(p["d"].nan_to_num(), ref.nan_to_num())


def _misaligned(p):
    p["layout"][100:128] = 1  # group 1 starts mid-block
    return p


def _padding_first(p):
    p["layout"][0:3] = -1
    p["layout"][3:6] = 0
    return p


def _short_m(p):
    p["a"] = (p["a"][0][:500].contiguous(), p["a"][1][:500])
    p["d"] = p["d"][:500]
    p["layout"] = p["layout"][:500].contiguous()
    return p


CONTIGUOUS_VIOLATIONS = {
    "segment_not_aligned": (_misaligned, "mix groups"),
    "padding_before_rows": (_padding_first, "mix groups"),
    "m_not_multiple_of_alignment": (_short_m, "multiple of the contiguous-layout alignment"),
    "group_out_of_range": (lambda p: (p["layout"].__setitem__(0, 4), p)[1], r"\[-1, 4\)"),
    "lhs_not_fp8": (lambda p: {**p, "a": (p["a"][0].to(torch.bfloat16), p["a"][1])}, "float8_e4m3fn"),
    "rhs_not_fp8": (lambda p: {**p, "b": (p["b"][0].float(), p["b"][1])}, "float8_e4m3fn"),
    "scales_not_fp32": (lambda p: {**p, "a": (p["a"][0], p["a"][1].double())}, "float32"),
    "out_not_bf16": (lambda p: {**p, "d": p["d"].float()}, "bfloat16"),
    "m_indices_not_int32": (lambda p: {**p, "layout": p["layout"].long()}, "int32"),
    "rhs_scales_wrong_shape": (lambda p: {**p, "b": (p["b"][0], p["b"][1][:, :1])}, "scales must have shape"),
    "out_wrong_shape": (lambda p: {**p, "d": p["d"][:, :128]}, "shape mismatch"),
}


@pytest.mark.parametrize("violation", sorted(CONTIGUOUS_VIOLATIONS))
def test_fake_contiguous_asserts_its_contract(deep_gemm, violation):
    breaker, message = CONTIGUOUS_VIOLATIONS[violation]
    p = breaker(_contiguous_problem())
    with pytest.raises(RuntimeError, match=message):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(p["a"], p["b"], p["d"], p["layout"])


@pytest.mark.parametrize("k,n", [(64, 128), (192, 128), (128, 96)])
def test_fake_needs_k_and_n_multiples_of_128(deep_gemm, k, n):
    m_indices = torch.zeros(128, dtype=torch.int32)
    a = (torch.zeros(128, k, dtype=FP8), torch.ones(128, (k + 127) // 128))
    b = (torch.zeros(1, n, k, dtype=FP8), torch.ones(1, (n + 127) // 128, (k + 127) // 128))
    with pytest.raises(RuntimeError, match="multiple of 128"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, torch.empty(128, n, dtype=torch.bfloat16), m_indices)


def _masked_problem(num_groups=3, m=64, n=128, k=256, counts=(4, 0, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    a_q, a_s = _quant_rows(torch.randn(num_groups, m, k, generator=g))
    b_q, b_s = experts_deep_gemm.quantize_fp8_per_block(torch.randn(num_groups, n, k, generator=g))
    return dict(
        a=(a_q, a_s),
        b=(b_q, b_s),
        d=torch.empty(num_groups, m, n, dtype=torch.bfloat16),
        masked_m=torch.tensor(counts, dtype=torch.int32),
        expected_m=m,
    )


def test_fake_masked_math_and_rows_past_the_count(deep_gemm):
    p = _masked_problem()
    deep_gemm.m_grouped_fp8_gemm_nt_masked(p["a"], p["b"], p["d"], p["masked_m"], p["expected_m"])
    a = _dequant_rows(*p["a"])
    b = _dequant_blocks(*p["b"])
    for group, count in enumerate(p["masked_m"].tolist()):
        torch.testing.assert_close(p["d"][group, :count].float(), a[group, :count] @ b[group].t(), rtol=1e-2, atol=1e-2)
        assert torch.isnan(p["d"][group, count:].float()).all()


MASKED_VIOLATIONS = {
    "masked_m_not_int32": (lambda p: {**p, "masked_m": p["masked_m"].long()}, "int32"),
    "expected_m_zero": (lambda p: {**p, "expected_m": 0}, "positive"),
    "expected_m_tensor": (lambda p: {**p, "expected_m": torch.tensor(16)}, "host-side int"),
    "lhs_not_fp8": (lambda p: {**p, "a": (p["a"][0].float(), p["a"][1])}, "float8_e4m3fn"),
    "out_not_bf16": (lambda p: {**p, "d": p["d"].half()}, "bfloat16"),
    "lhs_scales_wrong_shape": (lambda p: {**p, "a": (p["a"][0], p["a"][1][:, :, :1])}, "scales must have shape"),
    "masked_m_wrong_length": (lambda p: {**p, "masked_m": p["masked_m"][:2]}, "shape mismatch"),
}


@pytest.mark.parametrize("violation", sorted(MASKED_VIOLATIONS))
def test_fake_masked_asserts_its_contract(deep_gemm, violation):
    breaker, message = MASKED_VIOLATIONS[violation]
    p = breaker(_masked_problem())
    with pytest.raises(RuntimeError, match=message):
        deep_gemm.m_grouped_fp8_gemm_nt_masked(p["a"], p["b"], p["d"], p["masked_m"], p["expected_m"])


def test_fake_masked_m_must_be_a_multiple_of_the_block_m(deep_gemm):
    p = _masked_problem(num_groups=2, m=200, counts=(3, 200))
    with pytest.raises(RuntimeError, match="multiple of the block M"):
        deep_gemm.m_grouped_fp8_gemm_nt_masked(p["a"], p["b"], p["d"], p["masked_m"], 200)
    single = _masked_problem(num_groups=1, m=200, counts=(7,))
    deep_gemm.m_grouped_fp8_gemm_nt_masked(single["a"], single["b"], single["d"], single["masked_m"], 200)


def test_fake_2x_options(deep_gemm):
    p = _contiguous_problem()
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(p["a"], p["b"], p["d"], p["layout"], recipe=(1, 128, 128))
    with pytest.raises(NotImplementedError, match="psum"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(p["a"], p["b"], p["d"], p["layout"], use_psum_layout=True)
    with pytest.raises(RuntimeError, match="recipe"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(p["a"], p["b"], p["d"], p["layout"], recipe=(2, 128, 128))


def test_fake_helpers(deep_gemm):
    assert deep_gemm.get_mk_alignment_for_contiguous_layout() == 128
    assert deep_gemm.get_mk_alignment_for_contiguous_layout() == 128
    assert deep_gemm.get_tma_aligned_size(5, 4) == 8 and deep_gemm.ceil_div(5, 4) == 2

    x = torch.randn(5, 3)
    aligned = deep_gemm.get_mn_major_tma_aligned_tensor(x)
    assert aligned.shape == (5, 3) and aligned.stride() == (1, 8) and torch.equal(aligned, x)
    assert deep_gemm.get_mn_major_tma_aligned_tensor(aligned) is aligned
    x3 = torch.randn(2, 5, 3)
    aligned3 = deep_gemm.get_mn_major_tma_aligned_tensor(x3)
    assert aligned3.stride() == (24, 1, 8) and torch.equal(aligned3, x3)

    assert deep_gemm.get_num_sms() == fake_deep_gemm.DEVICE_NUM_SMS
    deep_gemm.set_num_sms(64)
    assert deep_gemm.get_num_sms() == 64
    deep_gemm.set_num_sms(0)  # 0: the whole device again
    assert deep_gemm.get_num_sms() == fake_deep_gemm.DEVICE_NUM_SMS
    for bad in (-1, fake_deep_gemm.DEVICE_NUM_SMS + 1):
        with pytest.raises(RuntimeError, match="multiProcessorCount"):
            deep_gemm.set_num_sms(bad)
    assert deep_gemm.get_mn_major_tma_aligned_tensor is deep_gemm.get_mn_major_tma_aligned_tensor
    fake_deep_gemm.install()  # a fresh install resets the cap
    assert deep_gemm.get_num_sms() == fake_deep_gemm.DEVICE_NUM_SMS


def test_install_and_uninstall_restore_sys_modules(monkeypatch):
    sentinel = types.ModuleType("deep_gemm")
    monkeypatch.setitem(sys.modules, "deep_gemm", sentinel)
    fake_deep_gemm.install()
    import deep_gemm

    assert deep_gemm is fake_deep_gemm and deep_gemm.IS_FAKE
    fake_deep_gemm.uninstall()
    assert sys.modules["deep_gemm"] is sentinel
    monkeypatch.delitem(sys.modules, "deep_gemm")
    with fake_deep_gemm.installed() as module:
        assert sys.modules["deep_gemm"] is module
    assert "deep_gemm" not in sys.modules


# ----------------------------------------------------------------------------- what the real library enforces


def test_fake_masked_needs_whole_blocks_even_below_one_block(deep_gemm):
    """DeepGEMM 2.x stores each group's D in block-M row boxes clipped only at G*M: with
    several groups a partial block (even M < 64) writes over the next group's rows."""
    p = _masked_problem(num_groups=2, m=12, counts=(3, 12))
    with pytest.raises(RuntimeError, match="multiple of the block M"):
        deep_gemm.m_grouped_fp8_gemm_nt_masked(p["a"], p["b"], p["d"], p["masked_m"], 12)


def test_odd_sm_count_fails_at_gemm_time(deep_gemm):
    p = _masked_problem(num_groups=1, m=200, counts=(7,))
    deep_gemm.set_num_sms(131)
    with pytest.raises(RuntimeError, match="num_sms % 2 == 0"):
        deep_gemm.m_grouped_fp8_gemm_nt_masked(p["a"], p["b"], p["d"], p["masked_m"], 200)


def test_import_failures_of_any_kind_get_the_message(monkeypatch, tmp_path):
    """DeepGEMM's import asserts (CUDA_HOME) and initialises its extension; any failure
    there gets the helpful message, not a bare AssertionError."""
    failing_import(monkeypatch, tmp_path, "deep_gemm", "CUDA_HOME is not set")
    with pytest.raises(ImportError, match=r"(?s)tandem\[gpu\].*AssertionError: CUDA_HOME is not set"):
        DeepGemmBatchedExperts()


def test_uses_the_2x_tma_helper_and_keeps_lhs_scales_as_they_are(deep_gemm):
    experts = DeepGemmBatchedExperts()
    assert experts._tma_align is deep_gemm.get_mn_major_tma_aligned_tensor
    # DeepEP low-latency scales: [E, R*T, H/128] float32, column-major in the last two dims.
    q = torch.zeros(E, 128, H, dtype=FP8)
    column_major = torch.ones(E, H // 128, 128).transpose(1, 2)
    tokens = ExpertTokens(q, column_major, torch.bfloat16, expert_num_tokens=torch.zeros(E, dtype=torch.int32))
    xq, xs = experts_deep_gemm._fp8_activations(tokens, power_of_two_scales=False, sm100=False)
    assert xs is column_major and experts._lhs_scales(xs, sm100=False) is column_major


def test_sm100_needs_power_of_two_scales(monkeypatch):
    """On SM100 DeepGEMM packs float32 scales into UE8M0 and traps on any other value: the
    adapters quantize with ceil-to-power-of-two scales there (as DeepGEMM's own
    per_token_cast_to_fp8(use_ue8m0=True) does) and refuse other architectures."""
    w1, w2 = _weights(seed=1)
    counts = torch.tensor([5, 0, 16, 1])
    x = (_activations((E, 16, H), seed=7) * 0.3).to(torch.bfloat16)  # scales that are not powers of two
    tokens = ExpertTokens(x, None, torch.bfloat16, expert_num_tokens=counts)
    with fake_deep_gemm.installed(arch_major=10):
        with pytest.raises(RuntimeError, match="UE8M0"):
            DeepGemmBatchedExperts(power_of_two_scales=False).apply(tokens, w1, w2)
        monkeypatch.setattr(experts_deep_gemm, "_arch_major", lambda device: 10)
        out = DeepGemmBatchedExperts().apply(tokens, w1, w2)
        standard, *_ = _standard_tokens(False)
        DeepGemmExperts().apply(standard, w1, w2)
    oracle = TorchBatchedExperts().apply(tokens, w1, w2)
    assert _rel_err(out, oracle) < 2 * FP8_REL_TOL
    monkeypatch.setattr(experts_deep_gemm, "_arch_major", lambda device: 12)
    with fake_deep_gemm.installed(), pytest.raises(RuntimeError, match="SM90.*SM100"):
        DeepGemmBatchedExperts().apply(tokens, w1, w2)


def test_fake_has_deep_gemm_2_6_1_names_only(deep_gemm):
    """The 1.x names DeepGEMM 2.6.1 removed are absent (code using them fails here as on the
    real library); the 2.6.1 fp8/fp4 aliases are present."""
    for removed in ("m_grouped_gemm_fp8_fp8_bf16_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
                    "get_col_major_tma_aligned_tensor", "get_m_alignment_for_contiguous_layout"):
        assert not hasattr(deep_gemm, removed), removed
    assert deep_gemm.m_grouped_fp8_fp4_gemm_nt_masked is deep_gemm.m_grouped_fp8_gemm_nt_masked


def test_fake_reads_no_device_value_on_the_host(deep_gemm, monkeypatch):
    """Value checks are device-side asserts: no `.item()`/`bool()`/`int()` of a tensor."""
    from tandem.testing import fake_deep_gemm as fake

    def forbidden(*args, **kwargs):
        raise AssertionError("the fake read a device value on the host")

    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "__bool__", forbidden)
    monkeypatch.setattr(torch.Tensor, "__int__", forbidden)
    monkeypatch.setattr(fake, "ARCH_MAJOR", 10)  # SM100: the UE8M0 scale check runs too
    p = _contiguous_problem()
    scales = p["a"][1]
    p["a"] = (p["a"][0], torch.exp2(torch.log2(scales).ceil()))
    p["b"] = (p["b"][0], torch.exp2(torch.log2(p["b"][1]).ceil()))
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(p["a"], p["b"], p["d"], p["layout"])
    m = _masked_problem()
    m["a"] = (m["a"][0], torch.exp2(torch.log2(m["a"][1]).ceil()))
    m["b"] = (m["b"][0], torch.exp2(torch.log2(m["b"][1]).ceil()))
    deep_gemm.m_grouped_fp8_gemm_nt_masked(m["a"], m["b"], m["d"], m["masked_m"], m["expected_m"])


def test_fake_sm_count_comes_from_the_device_or_the_install():
    from tandem.testing import fake_deep_gemm as fake

    with fake.installed(device_num_sms=114) as deep_gemm:
        assert deep_gemm.get_num_sms() == 114
    with fake.installed() as deep_gemm:
        expected = (
            torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            if torch.cuda.is_available() else fake.EMULATED_NUM_SMS
        )
        assert deep_gemm.get_num_sms() == expected


# ----------------------------------------------------------------------------- expected_m (gpu-review-2 N12)


def test_masked_expected_m_is_an_estimate_of_rows_per_expert(deep_gemm):
    """`expected_m` steers DeepGEMM's block/wave heuristics: it is the mean rows per expert
    if the whole budget arrived (`M * top_k / E_global`, M = R*T rows per local expert),
    rounded up to 16 and kept within [1, M], not the padded maximum."""
    w1, w2 = _weights()
    x = _activations((E, 200, H), seed=3).to(torch.bfloat16)
    tokens = ExpertTokens(x, None, torch.bfloat16, expert_num_tokens=torch.tensor([5, 0, 200, 1]))
    # E_local = 4 of 16 global experts (4 ranks), top-2: ceil(200 * 2 / 16) = 25 -> 32.
    DeepGemmBatchedExperts(top_k=2, num_experts=16).apply(tokens, w1, w2)
    assert deep_gemm.EXPECTED_M == [32, 32]
    deep_gemm.EXPECTED_M.clear()
    # One rank holding every expert, top-4 of 4: every row may reach every expert -> M.
    DeepGemmBatchedExperts(top_k=4, num_experts=4).apply(tokens, w1, w2)
    assert deep_gemm.EXPECTED_M == [200, 200]
    deep_gemm.EXPECTED_M.clear()
    small = ExpertTokens(x[:, :3], None, torch.bfloat16, expert_num_tokens=torch.tensor([1, 0, 3, 1]))
    DeepGemmBatchedExperts(top_k=1, num_experts=64).apply(small, w1, w2)
    assert deep_gemm.EXPECTED_M == [3, 3]  # ceil(3 / 64) = 1 -> 16, clamped to M = 3


def _expected_m_on_two_ranks(rank, world):
    fake_deep_gemm.install()
    from tests.support.moe_cases import NUM_EXPERTS, TOP_K, make_problem, run_kernel

    kernel = build_moe_kernel(
        "torch_a2a_ll", "deep_gemm", num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=128,
        dispatch_max_tokens_per_rank=64,
    )
    p = make_problem(rank, "random", num_tokens=12, hidden=128, intermediate=128)
    out = run_kernel(kernel, p, rank, world)
    return list(fake_deep_gemm.EXPECTED_M), _rel_err(out, p.reference())


@pytest.mark.slow
def test_build_moe_kernel_gives_the_masked_experts_top_k_and_the_global_expert_count():
    from tandem.testing import run_distributed

    # 2 ranks x T=64 rows per local expert, top-2 of 8 experts: ceil(128 * 2 / 8) = 32.
    for expected_m, err in run_distributed(_expected_m_on_two_ranks, 2):
        assert expected_m == [32, 32]
        assert err < ORACLE_REL_TOL


# ----------------------------------------------------------------------------- SM100 scale layouts (gpu-review-2 N10)


def _masked_tokens(seed: int = 7, rows: int = 16):
    x = _activations((E, rows, H), seed=seed).to(torch.bfloat16)
    return ExpertTokens(x, None, torch.bfloat16, expert_num_tokens=torch.tensor([5, 0, rows, 1]))


@pytest.mark.parametrize("cls", [DeepGemmBatchedExperts, DeepGemmExperts])
def test_sm100_weight_scales_are_transformed_once_per_weight(monkeypatch, cls):
    """On SM100 DeepGEMM packs float32 weight scales into UE8M0 on every call; the adapter
    does it once per weight (`transform_sf_into_required_layout`), again only when the
    weight changes, and hands the LHS scales over row-major (the library's fast pack; an
    MN-major copy would send it to its slow torch fallback). Same numbers as the library
    packing the float32 scales itself."""
    w1, w2 = _weights(seed=1)
    tokens = _masked_tokens() if cls is DeepGemmBatchedExperts else _standard_tokens(False)[0]
    with fake_deep_gemm.installed(arch_major=9):  # reference: the float32 power-of-two scales as they are
        reference = cls(power_of_two_scales=True).apply(tokens, w1, w2)
    monkeypatch.setattr(experts_deep_gemm, "_arch_major", lambda device: 10)
    with fake_deep_gemm.installed(arch_major=10) as dg:
        experts = cls()
        first = experts.apply(tokens, w1, w2)
        second = experts.apply(tokens, w1, w2)
        assert dg.SF_TRANSFORMS["rhs"] == 2  # w1 and w2, once each over two forwards
        assert dg.SF_TRANSFORMS["torch_fallback"] == 0
        assert torch.equal(first, reference) and torch.equal(second, reference)
        w1.mul_(0.5)  # in place: the version counter moves, the packed scales must follow
        third = experts.apply(tokens, w1, w2)
        assert dg.SF_TRANSFORMS["rhs"] == 3
    with fake_deep_gemm.installed(arch_major=9):
        assert torch.equal(third, cls(power_of_two_scales=True).apply(tokens, w1, w2))


def test_sm100_takes_packed_ue8m0_activations_as_they_are(monkeypatch):
    """DeepEP low-latency fp8 dispatch with `use_ue8m0=True` delivers packed int32 scales
    `[E, M, H/512]`, MN-major: on SM100 they go to the GEMM untouched (no dequantize and
    requantize), padded rows included; elsewhere they are unpacked and requantized."""
    w1, w2 = _weights(seed=1)
    counts = torch.tensor([5, 0, 100, 1])
    x = _activations((E, 100, H), seed=7)
    q, s = _quant_rows(x)  # power-of-two scales: exactly representable as UE8M0
    packed = (s.view(torch.int32) >> 23).to(torch.uint8)  # H = 128: one exponent byte per row
    packed = torch.cat([packed, torch.zeros(E, 100, 3, dtype=torch.uint8)], -1).view(torch.int32)
    mn_major = torch.empty(E, 1, 100, dtype=torch.int32).transpose(1, 2)
    mn_major.copy_(packed)
    tokens = ExpertTokens(q, mn_major, torch.bfloat16, expert_num_tokens=counts)
    float_tokens = ExpertTokens(q, s, torch.bfloat16, expert_num_tokens=counts)
    with fake_deep_gemm.installed(arch_major=9):
        reference = DeepGemmBatchedExperts(power_of_two_scales=True).apply(float_tokens, w1, w2)
        assert torch.equal(DeepGemmBatchedExperts().apply(tokens, w1, w2), DeepGemmBatchedExperts().apply(float_tokens, w1, w2))
    assert torch.equal(tokens.dequantized().float(), x.to(torch.bfloat16).float())
    monkeypatch.setattr(experts_deep_gemm, "_arch_major", lambda device: 10)
    calls = []
    real = experts_deep_gemm.quantize_fp8_per_token_group
    monkeypatch.setattr(
        experts_deep_gemm, "quantize_fp8_per_token_group", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k)
    )
    with fake_deep_gemm.installed(arch_major=10):
        experts = DeepGemmBatchedExperts()
        assert experts.takes_ue8m0_scales(torch.device("cpu"))
        out = experts.apply(tokens, w1, w2)
    assert calls == [(E, 128, 2 * I // 2)]  # only the intermediate activation is quantized (M padded to 128)
    assert torch.equal(out, reference)


def test_fake_transform_sf_follows_deep_gemm_2_6_1():
    """`transform_sf_into_required_layout`'s cases, and the combinations the GEMMs refuse."""
    w = torch.randn(2, 256, 384, generator=torch.Generator().manual_seed(4))
    q, s = experts_deep_gemm.quantize_fp8_per_block(w, power_of_two_scales=True)
    with fake_deep_gemm.installed(arch_major=9) as dg:
        assert dg.transform_sf_into_required_layout(s, 256, 384, (1, 128, 128), 2, is_sfa=False) is s
        with pytest.raises(RuntimeError, match="is_sfa"):
            dg.transform_sf_into_required_layout(s, 256, 384, (1, 128, 128), 2)
        packed_on_sm90 = torch.zeros(2, 256, 1, dtype=torch.int32)
        a = (torch.zeros(2, 128, 384, dtype=FP8), torch.ones(2, 128, 3))
        with pytest.raises(RuntimeError, match="SM90 takes float32 scales only"):
            dg.m_grouped_fp8_gemm_nt_masked(a, (q, packed_on_sm90), torch.empty(2, 128, 256, dtype=torch.bfloat16),
                                            torch.ones(2, dtype=torch.int32), 16)
    with fake_deep_gemm.installed(arch_major=10) as dg:
        packed = dg.transform_sf_into_required_layout(s, 256, 384, (1, 128, 128), 2, is_sfa=False)
        assert packed.dtype == torch.int32 and packed.shape == (2, 256, 1) and packed.stride() == (256, 1, 256)
        assert dg.SF_TRANSFORMS["rhs"] == 1
        # packed scales are checked, not transformed again
        assert dg.transform_sf_into_required_layout(packed, 256, 384, (1, 128), 2) is packed
        with pytest.raises(RuntimeError, match="disable_ue8m0_cast"):
            dg.m_grouped_fp8_gemm_nt_masked(a, (q, s), torch.empty(2, 128, 256, dtype=torch.bfloat16),
                                            torch.ones(2, dtype=torch.int32), 16, disable_ue8m0_cast=True)
        with pytest.raises(RuntimeError, match="MN-major and TMA-aligned"):
            row_major = torch.empty_strided((2, 256, 1), (256, 1, 1), dtype=torch.int32).copy_(packed)
            dg.m_grouped_fp8_gemm_nt_masked(a, (q, row_major),
                                            torch.empty(2, 128, 256, dtype=torch.bfloat16), torch.ones(2, dtype=torch.int32), 16)
        dg.SF_TRANSFORMS.clear()
        dg.m_grouped_fp8_gemm_nt_masked(a, (q, packed), torch.empty(2, 128, 256, dtype=torch.bfloat16),
                                        torch.ones(2, dtype=torch.int32), 16)
        assert dg.SF_TRANSFORMS == {"lhs": 1}  # float32 LHS scales are packed per call; packed weight scales are not
