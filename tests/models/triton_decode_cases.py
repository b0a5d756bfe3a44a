"""Cases run by `test_triton_decode_attention.py` in a subprocess started with
`TRITON_INTERPRET=1` (Triton's own library functions take their mode when triton is
imported, so the interpreter must be on before that; the name keeps pytest's main run from
collecting this module).

The Triton split-KV decode attention, run on CPU under the Triton interpreter, against a
plain torch reference: GQA and the MLA latent cache, float32 and bfloat16, requests of
length 1, on a block boundary and over several splits, a block table wider than needed.

Every cache slot that no request owns holds NaN (the unused blocks the table's spare
columns point at, and the tail of each request's last block): one read of them would make
the output NaN, so the kernel provably stops at `seq_lens`."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run under TRITON_INTERPRET=1 by test_triton_decode_attention.py", allow_module_level=True)
pytest.importorskip("triton")

from tandem.models import triton_decode_attention as tda  # noqa: E402
from tandem.models.paged_attention import AttentionMetadata, _decode_attention  # noqa: E402
from tests.support.paged_decode import paged_cache, reference  # noqa: E402

BLOCK = 4
#: 1 token; exactly two blocks; 37 = two 32-token tiles (two splits); 70 = three splits.
LENGTHS = [1, 2 * BLOCK, 37, 70]


def tolerance(dtype):
    # bfloat16: the kernel rounds the softmax weights to bf16 before P @ V, as on a GPU.
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, kv_heads", [(4, 1), (4, 2), (24, 1)])
def test_gqa_matches_reference_and_reads_only_cached_tokens(num_heads, kv_heads, dtype):
    dim = 8
    k_cache, table, keys = paged_cache(LENGTHS, BLOCK, kv_heads, dim, dtype, seed=1)
    # Distinct values in the same slots (NaN stays NaN where no token is).
    v_cache = k_cache.flip(-1) * 0.5 + 1
    values = [k.flip(-1) * 0.5 + 1 for k in keys]
    query = torch.randn(len(LENGTHS), num_heads, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    seq_lens = torch.tensor(LENGTHS, dtype=torch.int32)

    out = tda.triton_decode_attention(query, k_cache, v_cache, seq_lens, table, dim**-0.5)

    assert out.shape == (len(LENGTHS), num_heads, dim) and out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), reference(query, keys, values, dim**-0.5), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_latent_cache_matches_reference_and_the_torch_decode_path(dtype):
    """One latent KV head, row `kv_c (32) + k_pe (8)`; V is the `kv_c` prefix view."""
    lora, rope, num_heads = 32, 8, 16
    cache, table, rows = paged_cache(LENGTHS, BLOCK, 1, lora + rope, dtype, seed=3)
    query = torch.randn(len(LENGTHS), num_heads, lora + rope, generator=torch.Generator().manual_seed(4)).to(dtype)
    seq_lens = torch.tensor(LENGTHS, dtype=torch.int32)
    scale = (lora + rope) ** -0.5

    out = tda.triton_decode_attention(query, cache, cache[..., :lora], seq_lens, table, scale)

    assert out.shape == (len(LENGTHS), num_heads, lora) and not out.isnan().any()
    expected = reference(query, rows, [r[..., :lora] for r in rows], scale)
    torch.testing.assert_close(out.float(), expected, **tolerance(dtype))
    if dtype == torch.float32:  # the torch path reads the NaN slots (then masks): compare on a clean cache
        clean = cache.nan_to_num(0.0)
        metadata = AttentionMetadata(
            query_start_loc=torch.arange(len(LENGTHS) + 1, dtype=torch.int32), seq_lens=seq_lens, max_query_len=1,
            slot_mapping=torch.zeros(len(LENGTHS), dtype=torch.int64), block_table=table, block_size=BLOCK,
            decode_only=True,
        )
        torch.testing.assert_close(out, _decode_attention(query, clean, clean[..., :lora], metadata, scale))


@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_mla_query_given_in_two_parts_equals_the_whole(num_kv_splits):
    """gpu-review-3 G9: the absorbed latent query and the rotated rope part reach the kernel
    as two operands with their own strides (here views of wider tensors, heads-major), so
    MLA's decode concatenates nothing; the result is the one-tensor query's, bit for bit."""
    lora, rope, num_heads = 32, 8, 16
    cache, table, _ = paged_cache(LENGTHS, BLOCK, 1, lora + rope, torch.float32, seed=13)
    g = torch.Generator().manual_seed(14)
    q_latent = torch.randn(num_heads, len(LENGTHS), lora, generator=g).transpose(0, 1)
    q_rope = torch.randn(len(LENGTHS), num_heads, 3 * rope, generator=g)[..., rope : 2 * rope]
    seq_lens = torch.tensor(LENGTHS, dtype=torch.int32)
    whole = torch.cat((q_latent, q_rope), dim=-1)

    def attend(query, **parts):
        return tda.triton_decode_attention(query, cache, cache[..., :lora], seq_lens, table, 0.2, num_kv_splits, **parts)

    assert torch.equal(attend(q_latent, query_rope=q_rope), attend(whole))
    with pytest.raises(ValueError, match="as wide as V"):
        attend(whole, query_rope=q_rope)


def test_mla_at_deepseek_v2_lite_dims_in_bfloat16():
    """The production tiles: 16 heads over a 512 + 64 latent row, block size 16, 16-token
    tiles, a request of 40 tokens over three splits."""
    lora, rope, num_heads, lengths = 512, 64, 16, [1, 16, 17, 40]
    cache, table, rows = paged_cache(lengths, 16, 1, lora + rope, torch.bfloat16, seed=9, table_width=4)
    query = torch.randn(len(lengths), num_heads, lora + rope, generator=torch.Generator().manual_seed(10))
    query = query.to(torch.bfloat16)
    scale = (lora + rope) ** -0.5

    out = tda.triton_decode_attention(query, cache, cache[..., :lora], torch.tensor(lengths, dtype=torch.int32), table, scale)

    assert not out.isnan().any()
    expected = reference(query, rows, [r[..., :lora] for r in rows], scale)
    torch.testing.assert_close(out.float(), expected, **tolerance(torch.bfloat16))


def test_split_count_does_not_change_the_result():
    k_cache, table, _ = paged_cache(LENGTHS, BLOCK, 2, 8, torch.float32, seed=5)
    query = torch.randn(len(LENGTHS), 4, 8, generator=torch.Generator().manual_seed(6))
    seq_lens = torch.tensor(LENGTHS, dtype=torch.int32)
    outs = [tda.triton_decode_attention(query, k_cache, k_cache, seq_lens, table, 0.3, num_kv_splits=n) for n in (1, 3, 8)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outs[0], outs[2], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_one_split_writes_the_output_without_the_merge(layout, dtype):
    """gpu-review-3 G5: at one KV split (a batch that fills the GPU with one program per
    request) stage 1 writes the output and stage 2 is not launched; a padding request of
    length 0 and a padding row still read zero."""
    from tandem.platform import triton_launches

    lengths = [5, 0, 37]
    if layout == "mla":
        lora, rope, num_heads = 32, 8, 16
        cache, table, rows = paged_cache(lengths, BLOCK, 1, lora + rope, dtype, seed=11)
        value_cache, values = cache[..., :lora], [r[..., :lora] for r in rows]
    else:
        num_heads = 4
        cache, table, rows = paged_cache(lengths, BLOCK, 2, 8, dtype, seed=11)
        value_cache, values = cache.flip(-1) * 0.5 + 1, [r.flip(-1) * 0.5 + 1 for r in rows]
    query = torch.randn(len(lengths) + 1, num_heads, cache.shape[-1], generator=torch.Generator().manual_seed(12))
    query = query.to(dtype)
    scale = cache.shape[-1] ** -0.5
    launched = []

    with triton_launches.listening(launched.append):
        out = tda.triton_decode_attention(
            query, cache, value_cache, torch.tensor(lengths, dtype=torch.int32), table, scale, num_kv_splits=1
        )

    assert launched == ["_decode_split"]
    assert out.dtype == dtype and not out.isnan().any()
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[3:]) == 0
    torch.testing.assert_close(out[:3].float(), reference(query[:3], rows, values, scale), **tolerance(dtype))


def test_padding_requests_and_padding_rows_are_zero():
    """As in a captured graph: padding requests of length 0 (table pointing at NaN blocks)
    and query rows past the requests."""
    lengths = [5, 0, 3]
    k_cache, table, keys = paged_cache(lengths, BLOCK, 1, 8, torch.float32, seed=7)
    query = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(8))  # rows 3, 4: no request
    seq_lens = torch.tensor(lengths, dtype=torch.int32)

    out = tda.triton_decode_attention(query, k_cache, k_cache, seq_lens, table, 0.5)

    assert out.shape == (5, 2, 8)
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[3:]) == 0
    torch.testing.assert_close(out[:3], reference(query[:3], keys, keys, 0.5), atol=1e-5, rtol=1e-5)


def test_refuses_heads_that_do_not_group():
    cache = torch.zeros(2, BLOCK, 3, 8)
    with pytest.raises(ValueError, match="group"):
        tda.triton_decode_attention(
            torch.zeros(1, 4, 8), cache, cache, torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 1.0
        )


@pytest.mark.parametrize(
    "seq_lens, table, match",
    [
        (torch.ones(2, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int64), "block table must be int32"),
        (torch.ones(2, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int32).t(), "contiguous rows"),
        (torch.ones(2, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int32), "seq_lens must be a contiguous int32"),
        (torch.ones(4, dtype=torch.int32)[::2], torch.zeros(2, 3, dtype=torch.int32), "seq_lens must be"),
        (torch.ones(1, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), "1 seq_lens for 2"),
    ],
)
def test_refuses_metadata_the_kernels_would_misread(seq_lens, table, match):
    cache = torch.zeros(4, BLOCK, 1, 8)
    with pytest.raises(ValueError, match=match):
        tda.triton_decode_attention(torch.zeros(2, 2, 8), cache, cache, seq_lens, table, 1.0)
