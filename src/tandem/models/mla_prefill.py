"""MLA attention over the latent cache in its two forms, and which one a step's rows take.

The cache holds, per token, the normalised latent (`kv_lora_rank`) and the rotated shared
rope key (`qk_rope_head_dim`). Two ways to attend over it give the same result:

- *absorbed* (latent): each head's `q_nope` is folded through its key slice of `kv_b_proj`
  into the latent, so the cached row is the key (576 wide for V2/V3) and its latent part
  the value (512) of one KV head shared by every query head; the attended latent is then
  expanded through the value slice. Per query-key pair and head that is 2 * (576 + 512) =
  2,176 FLOPs, and d > 256 rules out Flash / cuDNN on a GPU.
- *per head* (vLLM's and SGLang's prefill): the cached latent is expanded through
  `kv_b_proj` into per-head `k_nope` (128) and `v` (128), the shared rope key appended, and
  plain multi-head attention runs at d_qk 192, d_v 128: 2 * (192 + 128) = 640 FLOPs per
  pair and head, 3.4x fewer.

Both forms spend 2 * kv_lora_rank * (qk_nope + v) FLOPs per head on a projection (262k for
V2/V3): the absorbed form per query row (q in, values out), the per-head form per key (K
and V out). So a prefill with nothing cached (keys = queries) always gains from the per-head
form; a short chunk over a long cached context (and a decode) would pay more to expand the
context than it saves, and stays absorbed: `per_head_pays`. Decode-only steps are always
absorbed, through the one capturable call (`paged_attention`: Triton's split-KV on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tandem.models.deepseek_config import DeepseekConfig
from tandem.models.paged_attention import (
    AttentionMetadata, VarlenRun, assemble_runs, attend_gathered, attend_run, gather_blocks, paged_attention,
    varlen_runs,
)  # fmt: skip
from tandem.platform.cpu_gemm import linear


def per_head_pays(cfg: DeepseekConfig, length: int, keys: int) -> bool:
    """Whether requests of `length` query rows over `keys` keys each (the gathered width)
    take no more FLOPs per head in the per-head form than in the absorbed one: the
    projections differ by `(keys - length) * expand`, the attention by `length * keys` pairs
    times the difference per pair (see the module's docstring)."""
    expand = 2 * cfg.kv_lora_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    latent_pair = 2 * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    per_head_pair = 2 * (cfg.qk_head_dim + cfg.v_head_dim)
    return (keys - length) * expand <= length * keys * (latent_pair - per_head_pair)


def mla_latent_attention(
    attn: nn.Module, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata
) -> torch.Tensor:
    """`[T, heads, v_head_dim]` for the rotated query parts of `attn` (an `MLAttention`:
    its `cfg`, `num_heads`, `scale`, `kv_b_proj`) over the latent `cache`, which
    already holds this step's rows. A decode-only step is one absorbed call; otherwise each
    run of equal query lengths (`varlen_runs`) takes the per-head form when it has more than
    one query row and `per_head_pays`, the absorbed form else (decodes)."""
    rank, scale = attn.cfg.kv_lora_rank, attn.scale
    if metadata.decode_only:

        def attend_decodes(q_latent: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
            return paged_attention(q_latent, cache, cache[..., :rank], metadata, scale, query_rope=q_pe)

        return _absorbed(attn, q_nope, q_rope, attend_decodes)
    attended = []
    for run in varlen_runs(metadata):
        rows = slice(run.start, run.stop)
        keys = run.length if run.from_start else run.block_table.shape[1] * cache.shape[1]
        if run.length > 1 and per_head_pays(attn.cfg, run.length, keys):
            out = _per_head(attn, q_nope[rows], q_rope[rows], cache, run)
        else:
            attend = lambda q, q_pe, run=run: attend_run(  # noqa: E731
                torch.cat((q, q_pe), -1), cache, cache[..., :rank], run, scale
            )
            out = _absorbed(attn, q_nope[rows], q_rope[rows], attend)
        attended.append((run, out))
    T = q_nope.shape[0]
    return assemble_runs(attended, q_nope, (T, attn.num_heads, attn.cfg.v_head_dim))


def _absorbed(
    attn: nn.Module, q_nope: torch.Tensor, q_rope: torch.Tensor, attend: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The absorbed form: `attend(q_latent, q_rope)` over the latent cache, each head's nope
    query folded into the latent (the two parts apart: the Triton decode kernel reads each
    where it is, with no `cat`), then each head's attended latent through its value slice."""
    c, T, nh = attn.cfg, q_nope.shape[0], attn.num_heads
    w_kv = attn.kv_b_proj.weight.view(nh, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    q_latent = torch.einsum("thn,hnl->thl", q_nope, w_kv[:, : c.qk_nope_head_dim])
    out_latent = attend(q_latent, q_rope)
    # Each head's latent through its value slice of kv_b_proj, written straight into
    # [T, heads, v] order (an einsum leaves [heads, T, v] for a copy to reorder).
    out = out_latent.new_empty((T, nh, c.v_head_dim))
    torch.bmm(out_latent.transpose(0, 1), w_kv[:, c.qk_nope_head_dim :].transpose(1, 2), out=out.transpose(0, 1))
    return out


def _per_head(
    attn: nn.Module, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, run: VarlenRun
) -> torch.Tensor:
    """The per-head form for one run: its requests' cached rows (this step's included)
    expanded through `kv_b_proj`, then multi-head attention at d_qk `qk_head_dim`, d_v
    `v_head_dim`, causal within the chunk and over the whole cached context before it."""
    c, nh = attn.cfg, attn.num_heads
    G, L, rank = run.requests, run.length, c.kv_lora_rank
    rows = gather_blocks(cache, run.block_table)  # [G, S, 1, rank + rope]
    if run.from_start:
        rows = rows[:, :L]
    S = rows.shape[1]
    kv = linear(rows[:, :, 0, :rank].flatten(0, 1), attn.kv_b_proj.weight).view(G, S, nh, -1)
    k_nope, value = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    key = torch.cat((k_nope, rows[..., rank:].expand(G, S, nh, c.qk_rope_head_dim)), dim=-1)
    query = torch.cat((q_nope, q_rope), dim=-1).view(G, L, nh, c.qk_head_dim)
    return attend_gathered(query, key, value, run.seq_lens, attn.scale, run.from_start).flatten(0, 1)


__all__ = ["mla_latent_attention", "per_head_pays"]
