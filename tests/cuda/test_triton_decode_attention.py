"""The Triton split-KV decode attention compiled on a real GPU (`python -m pytest -m cuda
tests/cuda`): against the dense reference at real shapes (DeepSeek-V2-Lite's MLA latent
cache, a GQA cache) with a block table as wide as a captured graph keeps, picked by
`paged_attention` for CUDA caches, and captured in a CUDA graph that follows new
`seq_lens` on replay with no host sync. Not yet run: no session so far had a GPU."""

from __future__ import annotations

import pytest
import torch

from tandem.models.paged_attention import AttentionMetadata, paged_attention
from tests.support.paged_decode import paged_cache, reference

pytestmark = pytest.mark.cuda

BLOCK = 16
WIDTH = 256  # blocks: max_model_len 4096, as a full graph's table
LENGTHS = [1, 16, 17, 150, 151, 300, 1000, 4096]
#: (query heads, kv heads, key dim, value dim): V2-Lite's absorbed MLA (kv_lora 512 + rope 64), GQA.
SHAPES = {"mla": (16, 1, 576, 512), "gqa": (32, 4, 128, 128)}


@pytest.fixture(autouse=True)
def interpreter_set_elsewhere(monkeypatch):
    """Another test module may have set TRITON_INTERPRET=1 in this process: CUDA tensors
    must take the compiled kernels all the same."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _problem(shape: str, dtype: torch.dtype, seed: int = 0):
    heads, kv_heads, key_dim, value_dim = SHAPES[shape]
    k_cache, table, keys = paged_cache(LENGTHS, BLOCK, kv_heads, key_dim, dtype, seed, WIDTH, device="cuda")
    if shape == "mla":  # V is the latent prefix of the same rows
        v_cache, values = k_cache[..., :value_dim], [k[..., :value_dim] for k in keys]
    else:
        v_cache, values = k_cache.flip(-1).contiguous(), [k.flip(-1) for k in keys]
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    query = torch.randn(len(LENGTHS), heads, key_dim, generator=g, device="cuda").to(dtype)
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(len(LENGTHS) + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(LENGTHS, dtype=torch.int32, device="cuda"), max_query_len=1,
        slot_mapping=torch.zeros(len(LENGTHS), dtype=torch.int64, device="cuda"), block_table=table,
        block_size=BLOCK, decode_only=True,
    )
    return query, k_cache, v_cache, metadata, reference(query, keys, values, key_dim**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_paged_attention_takes_the_triton_kernels_and_matches_the_reference(shape, dtype, monkeypatch):
    from tandem.models import paged_attention as module

    def gather_path(*args):
        raise AssertionError("a CUDA decode batch took the torch gather path")

    monkeypatch.setattr(module, "_decode_attention", gather_path)
    query, k_cache, v_cache, metadata, expected = _problem(shape, dtype)
    out = paged_attention(query, k_cache, v_cache, metadata, query.shape[-1] ** -0.5)
    assert not out.isnan().any()  # NaN fills every slot past each request's length
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(out.float(), expected, **tol)


def test_captured_graph_follows_new_seq_lens_without_host_sync():
    query, k_cache, v_cache, metadata, _ = _problem("mla", torch.bfloat16)
    scale = query.shape[-1] ** -0.5
    paged_attention(query, k_cache, v_cache, metadata, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            captured = paged_attention(query, k_cache, v_cache, metadata, scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    shorter = torch.tensor([1, 9, 17, 100, 0, 299, 999, 2048], dtype=torch.int32, device="cuda")
    metadata.seq_lens.copy_(shorter)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, paged_attention(query, k_cache, v_cache, metadata, scale), atol=0, rtol=0)
    assert torch.count_nonzero(captured[4]) == 0  # a padding request (seq_len 0)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_one_kv_split_writes_the_output_itself(shape):
    """The path a batch of 132 requests or more takes (`kv_splits_for`): stage 1 writes the
    bf16 output, no merge; a padding request of length 0 reads zero."""
    from tandem.models.triton_decode_attention import triton_decode_attention

    query, k_cache, v_cache, metadata, expected = _problem(shape, torch.bfloat16)
    seq_lens = metadata.seq_lens.clone()
    seq_lens[4] = 0
    expected[4] = 0
    scale = query.shape[-1] ** -0.5
    out = triton_decode_attention(query, k_cache, v_cache, seq_lens, metadata.block_table, scale, num_kv_splits=1)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(out[4]) == 0
