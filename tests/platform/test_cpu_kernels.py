"""tandem's CPU kernels (`tandem.platform.cpu_kernels`) against plain torch: the packed
few-row GEMM, the fused routed experts and the in-place paged decode attention, in float32 and
bfloat16, on shapes that leave tails (rows, panel columns, head dims); and where the engine
takes them (the experts' `apply`, decode attention) and where it must not (graph captures)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tandem.models.paged_attention import AttentionMetadata, _decode_attention, paged_attention
from tandem.modular_kernels.experts_torch import TorchExperts
from tandem.modular_kernels.interfaces import ExpertTokens
from tandem.platform import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="tandem's CPU kernels did not build here")

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 64, 32), (5, 100, 48), (13, 200, 40), (7, 3, 17)])
def test_packed_linear_equals_f_linear(dtype, rows, out_features, in_features):
    torch.manual_seed(rows)
    weight = torch.randn(out_features, in_features, dtype=dtype)
    x = torch.randn(2, rows, in_features, dtype=dtype)
    got = cpu_kernels.linear(x, cpu_kernels.pack(weight), out_features)
    expected = F.linear(x.float(), weight.float())
    assert got.dtype == dtype and got.shape == (2, rows, out_features)
    torch.testing.assert_close(got.float(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 10)


def _experts_reference(x, ids, weights, w13, w2):
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < w13.shape[0]:
                h = w13[e].float() @ x[t].float()
                out[t] += weights[t, j].float() * (w2[e].float() @ (F.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_equal_the_per_pair_sum_and_skip_other_ranks_experts(dtype):
    torch.manual_seed(1)
    tokens, hidden, experts, inter, top_k = 11, 80, 6, 40, 3
    x = torch.randn(tokens, hidden, dtype=dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=dtype) / 8
    w2 = torch.randn(experts, hidden, inter, dtype=dtype) / 8
    ids = torch.randint(0, experts, (tokens, top_k))
    ids[0] = -1  # every expert of row 0 lives on another rank: its output is zero
    ids[3, 1] = experts  # out of range: dropped
    weights = torch.rand(tokens, top_k, dtype=dtype)
    got = cpu_kernels.moe(x, ids, weights, cpu_kernels.pack(w13), cpu_kernels.pack(w2), inter)
    expected = _experts_reference(x, ids, weights, w13, w2)
    assert got.dtype == dtype and not got[0].any()
    torch.testing.assert_close(got.float(), expected, rtol=TOLERANCE[dtype] * 5, atol=TOLERANCE[dtype] * 5)


def test_experts_apply_takes_the_fused_kernel_and_equals_the_grouped_gemms(monkeypatch):
    """`TorchExperts.apply` on module weights runs the fused kernel; with it off, the sorted
    grouped GEMMs give the same output."""
    torch.manual_seed(2)
    w13 = torch.nn.Parameter(torch.randn(4, 64, 48) / 8, requires_grad=False)
    w2 = torch.nn.Parameter(torch.randn(4, 48, 32) / 8, requires_grad=False)
    x = torch.randn(9, 48)
    ids = torch.randint(-1, 4, (9, 2))
    tokens = ExpertTokens(x, None, torch.float32, topk_ids=ids, topk_weights=torch.rand(9, 2))
    calls = []
    real_moe = cpu_kernels.moe
    monkeypatch.setattr(cpu_kernels, "moe", lambda *a: calls.append(1) or real_moe(*a))
    fused = TorchExperts().apply(tokens, w13, w2)
    assert calls == [1]
    grouped = next(TorchExperts()._blocks(x, tokens, w13, w2, None))[1]
    torch.testing.assert_close(fused, grouped, rtol=1e-5, atol=1e-5)


def _decode_case(dtype, requests, kv_heads, heads, dim, value_dim=None, lengths=None):
    torch.manual_seed(0)
    block_size, width = 4, 5
    blocks = requests * width + 1
    key_cache = torch.randn(blocks, block_size, kv_heads, dim, dtype=dtype)
    value_cache = key_cache[..., :value_dim] if value_dim else torch.randn(blocks, block_size, kv_heads, dim, dtype=dtype)
    table = (torch.randperm(blocks - 1)[: requests * width].view(requests, width) + 1).int()
    lens = torch.tensor(lengths if lengths else torch.randint(1, width * block_size + 1, (requests,)).tolist(), dtype=torch.int32)
    query = torch.randn(requests, heads, dim, dtype=dtype)
    metadata = AttentionMetadata(
        torch.arange(requests + 1, dtype=torch.int32), lens, 1, torch.zeros(requests, dtype=torch.long), table,
        block_size, decode_only=True, query_start_loc_host=tuple(range(requests + 1)), seq_lens_host=tuple(lens.tolist()),
    )
    return query, key_cache, value_cache, metadata


@pytest.mark.parametrize(
    "dtype,requests,kv_heads,heads,dim,value_dim,lengths",
    [
        (torch.float32, 5, 2, 4, 32, None, None),  # GQA
        (torch.float32, 1, 2, 4, 16, None, [3]),  # one request, one block
        (torch.float32, 3, 1, 4, 24, 16, [9, 0, 20]),  # MLA's latent: values are the keys' first channels; a padding request
        (torch.float32, 6, 1, 2, 20, None, [1, 2, 3, 5, 7, 20]),  # head dim off the vector width: scalar tails
        (torch.bfloat16, 4, 2, 2, 16, None, None),
        # 8+ requests: a request's KV heads are one work item (rows streamed head after head)
        (torch.float32, 9, 3, 6, 40, None, [1, 17, 0, 20, 4, 16, 2, 19, 5]),
        (torch.bfloat16, 8, 2, 10, 64, None, None),  # 5 query heads per KV head: two passes of up to four
        (torch.float32, 8, 1, 4, 24, 16, [9, 0, 20, 3, 1, 16, 17, 4]),  # MLA's latent, many requests
    ],
)
def test_in_place_decode_attention_equals_the_gathered_one(dtype, requests, kv_heads, heads, dim, value_dim, lengths):
    query, key_cache, value_cache, metadata = _decode_case(dtype, requests, kv_heads, heads, dim, value_dim, lengths)
    scale = dim**-0.5
    expected = _decode_attention(query, key_cache, value_cache, metadata, scale, in_place=False)
    got = paged_attention(query, key_cache, value_cache, metadata, scale)
    torch.testing.assert_close(got, expected, rtol=TOLERANCE[dtype] * 5, atol=TOLERANCE[dtype] * 5)
    assert got.dtype == dtype and got.shape == (requests, heads, value_dim or dim)
    if lengths and 0 in lengths:
        assert not got[lengths.index(0)].any()
    direct = cpu_kernels.decode_attention(query, key_cache, value_cache, metadata.block_table, metadata.seq_lens, scale)
    torch.testing.assert_close(direct, got, rtol=0, atol=0)


def test_decode_attention_refuses_heads_that_do_not_group():
    query, key_cache, value_cache, metadata = _decode_case(torch.float32, 2, 3, 4, 16)
    with pytest.raises(ValueError, match="4 query heads do not group over 3 KV heads"):
        cpu_kernels.decode_attention(query, key_cache, value_cache, metadata.block_table, metadata.seq_lens, 1.0)


def test_graph_captures_never_take_the_kernels():
    """A `CpuGraph` records ATen ops: a ctypes call inside a capture would vanish from its
    replays, so under a capture the experts and attention keep their torch paths."""
    from tandem.platform.cpu_gemm import fused_experts
    from tandem.platform.graph import _CaptureState, _capturing

    w13 = torch.nn.Parameter(torch.randn(2, 32, 16), requires_grad=False)
    w2 = torch.nn.Parameter(torch.randn(2, 16, 16), requires_grad=False)
    x, ids, weights = torch.randn(3, 16), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    assert fused_experts(x, ids, weights, w13, w2) is not None
    query, key_cache, value_cache, _ = _decode_case(torch.float32, 2, 1, 2, 16)
    from tandem.models.paged_attention import _in_place_decode_applies

    assert _in_place_decode_applies(query, key_cache, value_cache)
    with _capturing(_CaptureState()):
        assert fused_experts(x, ids, weights, w13, w2) is None
        assert not _in_place_decode_applies(query, key_cache, value_cache)


def test_the_library_is_built_once_per_source_and_can_be_switched_off(tmp_path):
    script = "from tandem.platform import cpu_kernels as k; print(k.available(), sorted(p.name for p in k.cache_dir().glob('*.so')))"
    env = {**os.environ, "TANDEM_KERNEL_CACHE": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert first.stdout.startswith("True") and first.stdout == second.stdout
    assert len(list(tmp_path.glob("*.so"))) == 1 and not list(tmp_path.glob("tmp*"))
    off = subprocess.run([sys.executable, "-c", script], env=env | {"TANDEM_CPU_KERNELS": "0"}, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert off.stdout.startswith("False")


def test_calls_without_rows_return_empty_outputs():
    """A rank that received no tokens (expert parallel) or a ubatch without requests."""
    w13, w2 = cpu_kernels.pack(torch.randn(4, 64, 32)), cpu_kernels.pack(torch.randn(4, 32, 32))
    out = cpu_kernels.moe(torch.randn(0, 32), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), w13, w2, 32)
    assert out.shape == (0, 32)
    cache = torch.randn(3, 4, 2, 16)
    empty = torch.zeros(0, dtype=torch.int32)
    assert cpu_kernels.decode_attention(torch.randn(0, 4, 16), cache, cache, empty.view(0, 1), empty, 1.0).shape == (0, 4, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [300, 2304])
def test_dense_projections_of_few_rows_take_the_panel_kernel(monkeypatch, dtype, out_features):
    """One row, or up to 32 on AMX tiles (bfloat16) or of a small float32 weight (up to 2^19
    elements), runs tandem's kernel; more rows run oneDNN's packed GEMM. Both equal `F.linear`."""
    from tandem.platform import cpu_gemm

    torch.manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(out_features, 256, dtype=dtype) / 16, requires_grad=False)
    calls = []
    real_linear = cpu_kernels.linear
    monkeypatch.setattr(cpu_kernels, "linear", lambda *a: calls.append(a[0].shape[0]) or real_linear(*a))
    small = dtype == torch.float32 and weight.numel() <= 1 << 19
    limit = 32 if (dtype == torch.bfloat16 and cpu_kernels.uses_amx()) or small else 1
    for rows in sorted({1, 2, limit, limit + 1}):
        x = torch.randn(rows, 256, dtype=dtype)
        expected = F.linear(x.float(), weight.float())
        torch.testing.assert_close(cpu_gemm.linear(x, weight).float(), expected, rtol=TOLERANCE[dtype] * 5, atol=TOLERANCE[dtype] * 20)
    assert calls == sorted({1, 2, limit} if limit > 1 else {1})


def _rotary(dim: int, interleaved: bool):
    from tandem.models.rope import RopeConfig, RotaryEmbedding

    yarn = RopeConfig("yarn", 10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.7,
                      max_positions=256)  # fmt: skip
    return RotaryEmbedding(dim, yarn, interleaved=interleaved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dim", [16, 40, 128])  # pairs below, across and at whole vectors
def test_rope_and_cache_gives_the_torch_paths_bits(interleaved, dtype, dim):
    """GQA's layout: the rotated query, the rotated key in the key cache and the value in the
    value cache equal the torch path's to the bit; a padding row (slot -1) and a row past the
    slot mapping write nothing but still get their query rotated."""
    from tandem.models.paged_attention import write_to_cache

    rotary = _rotary(dim, interleaved)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, heads, dim, generator=g).to(dtype) for heads in (4, 2, 2))
    q[0, 0, 1] = float("nan")  # a NaN stays a NaN where torch's stays
    positions = torch.tensor([4, 9, 9, 30, 0, 255])
    slots = torch.tensor([3, 7, 12, 0, -1])  # row 5 is past the mapping
    key_cache, value_cache = torch.zeros(4, 4, 2, dim, dtype=dtype), torch.zeros(4, 4, 2, dim, dtype=dtype)
    want_q, want_k = rotary(positions, q, k)
    want_keys, want_values = key_cache.clone(), value_cache.clone()
    write_to_cache(want_keys, want_k, slots)
    write_to_cache(want_values, v, slots)
    got_q = cpu_kernels.rope_and_cache(positions, q, k, v, rotary.cos_sin_cache, slots, key_cache, value_cache, interleaved)
    assert got_q.is_contiguous() and got_q.dtype == dtype
    assert torch.equal(got_q.nan_to_num(7.0), want_q.nan_to_num(7.0))
    assert torch.equal(got_q.isnan(), want_q.isnan())
    assert torch.equal(key_cache, want_keys) and torch.equal(value_cache, want_values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_writes_mlas_latent_row(monkeypatch, dtype):
    """MLA's latent cache row `[latent, rotated shared key]`: the key and the copy are slices
    of one cache, the query a strided view; `rotate_and_cache` takes the kernel."""
    rank, rope_dim = 24, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 16 + rope_dim, generator=g).to(dtype)
    kv = torch.randn(3, rank + rope_dim, generator=g).to(dtype)
    latent, k_rope = kv[:, :rank].contiguous(), kv[:, rank:].unsqueeze(1)
    positions, slots = torch.tensor([2, 40, 41]), torch.tensor([5, 1, 2])
    cache, want_cache = torch.zeros(2, 4, 1, rank + rope_dim, dtype=dtype), torch.zeros(2, 4, 1, rank + rope_dim, dtype=dtype)
    rotary = _rotary(rope_dim, True)
    with cpu_kernels.switched_off():
        want_q = rotary.rotate_and_cache(positions, q[..., 16:], k_rope, slots, want_cache[..., rank:],
                                         copy=(latent.unsqueeze(1), want_cache[..., :rank]))  # fmt: skip
    calls = []
    real = cpu_kernels.rope_and_cache
    monkeypatch.setattr(cpu_kernels, "rope_and_cache", lambda *a: calls.append(1) or real(*a))
    got_q = rotary.rotate_and_cache(positions, q[..., 16:], k_rope, slots, cache[..., rank:],
                                    copy=(latent.unsqueeze(1), cache[..., :rank]))  # fmt: skip
    assert calls == [1]
    assert torch.equal(got_q, want_q) and torch.equal(cache, want_cache)


def test_rope_and_cache_refuses_positions_and_slots_outside_their_tables():
    rotary = _rotary(16, False)
    q, k = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    cache = torch.zeros(2, 4, 1, 16)
    with pytest.raises(IndexError, match="outside the rotary table's 256 rows"):
        cpu_kernels.rope_and_cache(torch.tensor([0, 256]), q, k, k, rotary.cos_sin_cache, torch.tensor([0, 1]), cache,
                                   cache.clone(), False)  # fmt: skip
    with pytest.raises(IndexError, match="outside the cache's 8 slots"):
        cpu_kernels.rope_and_cache(torch.tensor([0, 1]), q, k, k, rotary.cos_sin_cache, torch.tensor([0, 8]), cache,
                                   cache.clone(), False)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 40), (2, 5, 32), (1, 1024)])
def test_rms_norm_and_the_residual_add_equal_torchs(dtype, shape):
    """Normalised in float32, cast back, then scaled, as torch does; with the residual, the
    sum rounded to the dtype first (the next residual). Rows of a strided view are read in place."""
    from tandem.models.norm import fused_add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(len(shape))
    wide = torch.randn(*shape[:-1], shape[-1] + 8, generator=g).to(dtype)
    x = wide[..., 4 : 4 + shape[-1]]  # rows strided in memory
    residual = torch.randn(shape, generator=g).to(dtype)
    weight = torch.nn.Parameter((1 + torch.randn(shape[-1], generator=g) / 4).to(dtype), requires_grad=False)
    with cpu_kernels.switched_off():
        want = F.rms_norm(x, (shape[-1],), weight, 1e-6)
        want_normed, want_total = fused_add_rms_norm(x, residual, weight, 1e-6)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    got = rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **tolerance)
    normed, total = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, want_total)
    torch.testing.assert_close(normed, want_normed, **tolerance)
    with torch.profiler.profile() as profile:
        rms_norm(x, weight, 1e-6)
        fused_add_rms_norm(x, residual, weight, 1e-6)
    counted = [e.name for e in profile.events() if e.name.startswith("tandem::")]
    assert counted == ["tandem::cpu_rms_norm", "tandem::cpu_add_rms_norm"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_routing_in_one_call_equals_torchs(dtype, renormalize):
    """Mixtral / Qwen-MoE routing: the same experts in the same order as softmax + topk, the
    weights equal to float32 rounding; ties go to the lower expert; DeepSeek's grouped
    routing keeps the torch path."""
    from tandem.modular_kernels.routing import select_experts

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(37, 16, generator=g).to(dtype)
    logits[3, 5] = logits[3, 2] = 9.0  # a tie at the top
    with cpu_kernels.switched_off():
        want_weights, want_ids = select_experts(logits, 4, renormalize=renormalize)
    with torch.profiler.profile() as profile:
        weights, ids = select_experts(logits, 4, renormalize=renormalize)
    assert [e.name for e in profile.events() if e.name.startswith("tandem::")] == ["tandem::cpu_topk_softmax"]
    # The same experts up to ties (which torch.topk leaves in no set order; bfloat16 has many).
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids)) and ids.dtype == torch.int64
    if dtype == torch.float32:
        assert torch.equal(ids[torch.arange(37) != 3], want_ids[torch.arange(37) != 3])
    assert ids[3, :2].tolist() == [2, 5]
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    assert weights.dtype == torch.float32
    scaled, _ = select_experts(logits, 4, renormalize=renormalize, routed_scaling_factor=2.5)
    torch.testing.assert_close(scaled, weights * 2.5)
    with torch.profiler.profile() as profile:
        select_experts(logits, 4, renormalize=True, num_expert_group=4, topk_group=2)
    assert not [e.name for e in profile.events() if e.name.startswith("tandem::")]
