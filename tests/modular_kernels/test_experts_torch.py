"""TorchExperts (STANDARD format): the expert-sorted grouped GEMM against the per-token oracle,
and the shape of its work (no per-expert op, no weight copy)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.modular_kernels import ExpertTokens, TorchExperts, torch_moe_reference

H, I, K = 64, 32, 2


def _problem(num_rows: int, num_experts: int, dtype=torch.float32, seed: int = 0, used_experts: int | None = None):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(num_experts, 2 * I, H, generator=g) * H**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, H, I, generator=g) * I**-0.5).to(dtype)
    x = torch.randn(num_rows, H, generator=g).to(dtype)
    ids = torch.randint(-1, used_experts or num_experts, (num_rows, K), generator=g)
    weights = torch.rand(num_rows, K, generator=g)
    return x, w1, w2, ids, weights


def _apply(x, w1, w2, ids, weights, blocks=None):
    tokens = ExpertTokens(x, None, x.dtype, topk_ids=ids, topk_weights=weights)
    if blocks is None:
        return TorchExperts().apply(tokens, w1, w2)
    return [out for _, out in TorchExperts().apply_blocks(tokens, w1, w2, blocks)]


def test_matches_the_oracle_with_dropped_ids_padding_rows_and_empty_experts():
    x, w1, w2, ids, weights = _problem(40, 16, used_experts=6)  # experts 6..15 receive nothing
    ids[5:9] = -1  # padding rows: no expert on this rank
    x[5:9] = float("nan")  # never read: a padding row's garbage must not leak into real rows
    out = _apply(x, w1, w2, ids, weights)
    expected = torch_moe_reference(x.nan_to_num(), w1, w2, weights, ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(out[5:9]) == 0


def test_no_rows_and_no_valid_pair_give_zeros():
    x, w1, w2, ids, weights = _problem(0, 4)
    assert _apply(x, w1, w2, ids, weights).shape == (0, H)
    x, w1, w2, ids, weights = _problem(3, 4)
    assert torch.count_nonzero(_apply(x, w1, w2, torch.full_like(ids, -1), weights)) == 0


def test_bf16_computes_in_bf16_within_rounding_of_the_fp32_oracle():
    x, w1, w2, ids, weights = _problem(33, 8, dtype=torch.bfloat16, seed=1)
    out = _apply(x, w1, w2, ids, weights)
    assert out.dtype == torch.bfloat16
    expected = torch_moe_reference(x.float(), w1.float(), w2.float(), weights, ids)
    assert ((out.float() - expected).norm() / expected.norm()).item() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float64: the per-expert mm fallback
def test_blocks_equal_apply_on_their_rows(dtype):
    x, w1, w2, ids, weights = _problem(12, 8, dtype=dtype, seed=2)
    blocks = [torch.tensor([3, 0, 7]), torch.tensor([], dtype=torch.long), torch.tensor([11, 1, 2, 4]),
              torch.tensor([5, 6, 8, 9])]  # row 10 is in no block
    whole = _apply(x, w1, w2, ids, weights)
    parts = _apply(x, w1, w2, ids, weights, blocks)
    assert [p.shape[0] for p in parts] == [3, 0, 4, 4]
    for rows, part in zip(blocks, parts):
        torch.testing.assert_close(part, whole[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole, torch_moe_reference(x, w1, w2, weights, ids), atol=1e-5, rtol=1e-5)


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        # Views alias their input (a transposed weight is no copy): only new tensors count.
        largest = 0 if func.is_view else max((t.numel() for t in tensors), default=0)
        self.ops.append((str(func.overloadpacket), largest))
        return out


def _ops(num_experts: int) -> list[tuple[str, int]]:
    x, w1, w2, ids, weights = _problem(24, num_experts, seed=3, used_experts=8)
    ids = ids.clamp(min=0) * (num_experts // 8)  # the same 8 active experts, spread over the range
    # The first call on CPU packs each expert's weights once for oneDNN (tandem.platform.
    # cpu_gemm): a copy made at first use, not per call. The calls after it are what count.
    _apply(x, w1, w2, ids, weights)
    with _OpLog() as log:
        _apply(x, w1, w2, ids, weights)
    return log.ops


def test_work_does_not_grow_with_the_number_of_experts_nor_copy_weights():
    few, many = _ops(8), _ops(64)
    assert [name for name, _ in few] == [name for name, _ in many]
    assert not any(name == "nonzero" for name, _ in many)
    one_expert = 2 * I * H
    assert max(size for _, size in many) < one_expert  # no tensor made as large as one expert's weights
