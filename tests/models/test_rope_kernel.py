"""RoPE: the cos/sin table against the per-position formula, the per-step gather shared by
layers, and the fused RoPE + cache-write Triton kernel (under the interpreter) against the
torch path, both pair layouts, float32 and bfloat16; MLA's latent normalised inside that
kernel against the norm run first."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tandem.models.norm import rms_norm  # noqa: E402
from tandem.models.paged_attention import write_to_cache  # noqa: E402
from tandem.models.rope import RopeConfig, RotaryEmbedding, rope_frequencies  # noqa: E402
from tandem.models.rope_kernel import rope_and_cache_triton  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
YARN = RopeConfig("yarn", 10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.7, max_positions=256)


@pytest.mark.parametrize("rope", [RopeConfig("default", 10000.0, max_positions=128), YARN], ids=["default", "yarn"])
def test_table_rows_are_the_per_position_cos_and_sin(rope):
    rotary = RotaryEmbedding(16, rope)
    inv_freq, factor = rope_frequencies(rope, 16)
    positions = torch.tensor([0, 5, 127])
    freqs = positions.float().unsqueeze(-1) * inv_freq
    cos, sin = rotary.cos_sin(positions, torch.float32)
    torch.testing.assert_close(cos.squeeze(1), freqs.cos() * factor)
    torch.testing.assert_close(sin.squeeze(1), freqs.sin() * factor)


def test_gather_is_reused_for_the_same_positions_until_they_change():
    rotary = RotaryEmbedding(8, RopeConfig("default", 10000.0, max_positions=32))
    positions = torch.tensor([1, 2, 3])
    first = rotary.cos_sin(positions, torch.float32)
    assert rotary.cos_sin(positions, torch.float32)[0] is first[0]  # the next layer: no new gather
    assert rotary.cos_sin(positions, torch.bfloat16)[0].dtype == torch.bfloat16
    positions.copy_(torch.tensor([4, 5, 6]))  # a static buffer refilled for the next step
    cos, _ = rotary.cos_sin(positions, torch.float32)
    torch.testing.assert_close(cos, RotaryEmbedding(8, RopeConfig("default", 10000.0, max_positions=32)).cos_sin(torch.tensor([4, 5, 6]), torch.float32)[0])


def _qk(dtype, tokens=5, q_heads=4, k_heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, q_heads, dim, generator=g).to(dtype), torch.randn(tokens, k_heads, dim, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_rope_in_place_matches_torch(interleaved, dtype):
    rotary = RotaryEmbedding(16, YARN, interleaved=interleaved)
    q, k = _qk(dtype)
    positions = torch.tensor([0, 3, 17, 100, 255])
    want_q, want_k = rotary(positions, q, k)
    rope_and_cache_triton(rotary.cos_sin_cache, positions, q, k, interleaved=interleaved)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_rope_and_cache_write_matches_torch(interleaved, dtype):
    """GQA's layout: rotated K into the key cache, V copied into the value cache; a padding
    row (slot -1) writes nothing."""
    rotary = RotaryEmbedding(16, YARN, interleaved=interleaved)
    q, k = _qk(dtype)
    v = torch.randn(5, 2, 16).to(dtype)
    positions = torch.tensor([4, 9, 9, 30, 0])
    slots = torch.tensor([3, 7, 12, 0, -1])
    key_cache, value_cache = torch.zeros(4, 4, 2, 16, dtype=dtype), torch.zeros(4, 4, 2, 16, dtype=dtype)
    want_q, want_k = rotary(positions, q, k)
    want_keys, want_values = key_cache.clone(), value_cache.clone()
    write_to_cache(want_keys, want_k, slots)
    write_to_cache(want_values, v, slots)
    rope_and_cache_triton(
        rotary.cos_sin_cache, positions, q, k, interleaved=interleaved, slot_mapping=slots, k_cache=key_cache,
        copy=(v, value_cache),
    )
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(key_cache, want_keys, **TOL[dtype])
    assert torch.equal(value_cache, want_values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mla_row_matches_torch(dtype):
    """MLA's latent cache row: [latent, rotated shared key], q_rope a strided view of q."""
    rank, rope_dim = 24, 8
    rotary = RotaryEmbedding(rope_dim, YARN, interleaved=True)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 16 + rope_dim, generator=g).to(dtype)
    kv = torch.randn(3, rank + rope_dim, generator=g).to(dtype)
    latent, k_rope = kv[:, :rank].contiguous(), kv[:, rank:].unsqueeze(1)
    positions, slots = torch.tensor([2, 40, 41]), torch.tensor([5, 1, 2])
    cache = torch.zeros(2, 4, 1, rank + rope_dim, dtype=dtype)
    want_cache = cache.clone()
    torch_rotary = RotaryEmbedding(rope_dim, YARN, interleaved=True)
    want_q = torch_rotary.rotate_and_cache(
        positions, q[..., 16:].clone(), k_rope, slots, want_cache[..., rank:], copy=(latent.unsqueeze(1), want_cache[..., :rank])
    )
    q_rope = q[..., 16:]
    rope_and_cache_triton(
        rotary.cos_sin_cache, positions, q_rope, k_rope, interleaved=True, slot_mapping=slots,
        k_cache=cache[..., rank:], copy=(latent.unsqueeze(1), cache[..., :rank]),
    )
    torch.testing.assert_close(q_rope, want_q, **TOL[dtype])
    torch.testing.assert_close(cache, want_cache, **TOL[dtype])
    assert torch.equal(cache[..., :rank].flatten(0, 1)[slots], latent.unsqueeze(1))


def _mla_rows(dtype, rank=24, rope_dim=8, tokens=3):
    """`(q, latent, k_rope, norm weight)`: the latent a strided view of the `kv_a` output,
    as MLA's `prepare` leaves it."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(tokens, 2, 16 + rope_dim, generator=g).to(dtype)
    kv = (3 * torch.randn(tokens, rank + rope_dim, generator=g)).to(dtype)
    weight = (1 + 0.5 * torch.randn(rank, generator=g)).to(dtype)
    return q, kv[:, :rank], kv[:, rank:].unsqueeze(1), weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_latent_norm_in_the_cache_write_matches_the_norm_first(dtype):
    """gpu-review-3 G9: `kv_a_layernorm` inside the RoPE + cache-write kernel writes the
    same cache row as `rms_norm` run first and its output copied (the unfused path), float32
    to its last bits, bfloat16 within the file's tolerance (the interpreter's casts to
    bfloat16 truncate where a GPU rounds to nearest); a padding row writes nothing."""
    rank, rope_dim, eps = 24, 8, 1e-6
    rotary = RotaryEmbedding(rope_dim, YARN, interleaved=True)
    q, latent, k_rope, weight = _mla_rows(dtype)
    positions, slots = torch.tensor([2, 40, 41]), torch.tensor([5, -1, 2])
    cache = torch.zeros(2, 4, 1, rank + rope_dim, dtype=dtype)
    unfused_cache, unfused_q = cache.clone(), q.clone()
    rope_and_cache_triton(
        rotary.cos_sin_cache, positions, unfused_q[..., 16:], k_rope, interleaved=True, slot_mapping=slots,
        k_cache=unfused_cache[..., rank:], copy=(rms_norm(latent, weight, eps).unsqueeze(1), unfused_cache[..., :rank]),
    )
    rope_and_cache_triton(
        rotary.cos_sin_cache, positions, q[..., 16:], k_rope, interleaved=True, slot_mapping=slots,
        k_cache=cache[..., rank:], copy=(latent.unsqueeze(1), cache[..., :rank]), normalise_copy=(weight, eps),
    )
    assert torch.equal(q, unfused_q)
    torch.testing.assert_close(cache, unfused_cache, **(dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else TOL[dtype]))
    assert cache.flatten(0, 2)[[0, 1, 3, 4, 6, 7]].eq(0).all(), "a slot no token maps to was written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_latent_norm_with_the_cache_write_matches_the_norm_first(dtype):
    """The CPU path of `rotate_and_cache(normalise_copy=...)` normalises before its kernel:
    the same bits as the norm run first."""
    rank, rope_dim, eps = 24, 8, 1e-6
    rotary = RotaryEmbedding(rope_dim, YARN, interleaved=True)
    q, latent, k_rope, weight = _mla_rows(dtype)
    positions, slots = torch.tensor([2, 40, 41]), torch.tensor([5, 1, 2])
    cache = torch.zeros(2, 4, 1, rank + rope_dim, dtype=dtype)
    unfused_cache = cache.clone()
    want_q = rotary.rotate_and_cache(
        positions, q[..., 16:].clone(), k_rope, slots, unfused_cache[..., rank:],
        copy=(rms_norm(latent, weight, eps).unsqueeze(1), unfused_cache[..., :rank]),
    )
    got_q = rotary.rotate_and_cache(
        positions, q[..., 16:].clone(), k_rope, slots, cache[..., rank:],
        copy=(latent.unsqueeze(1), cache[..., :rank]), normalise_copy=(weight, eps),
    )
    assert torch.equal(got_q, want_q)
    assert torch.equal(cache, unfused_cache)
