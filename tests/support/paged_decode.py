"""A paged KV cache with NaN in every slot no request owns, and the dense reference its
decode attention must equal: shared by the Triton decode attention's interpreter cases and
its CUDA test."""

from __future__ import annotations

import torch


def paged_cache(lengths, block_size, kv_heads, dim, dtype, seed=0, table_width=24, device="cpu"):
    """A NaN-filled cache `[blocks, block_size, kv_heads, dim]` with each request's tokens
    written through a scattered block table `table_width` blocks wide (spare columns point at
    block 0, all NaN); returns `(cache, block_table, per-request dense rows)`."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 1 + table_width * len(lengths)
    cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 stays all NaN
    table = torch.zeros((len(lengths), table_width), dtype=torch.int32)  # spare columns -> block 0
    dense = []
    for r, n in enumerate(lengths):
        rows = torch.randn(n, kv_heads, dim, generator=g).to(dtype)
        used = -(-n // block_size)
        table[r, :used] = order[r * table_width : r * table_width + used].to(torch.int32)
        for p in range(n):
            cache[table[r, p // block_size], p % block_size] = rows[p]
        dense.append(rows)
    return cache.to(device), table.to(device), [rows.to(device) for rows in dense]


def reference(query, keys, values, scale):
    """float32 softmax attention of each request's one query row over its dense K/V."""
    outs = []
    for q, k, v in zip(query, keys, values):
        if k.shape[0] == 0:
            outs.append(torch.zeros(q.shape[0], v.shape[-1], device=q.device))
            continue
        group = q.shape[0] // k.shape[1]
        k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", q.float(), k) * scale
        outs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return torch.stack(outs)
