"""A small MLA layer and a step runner over a fresh paged cache: the harness the MLA prefill
and projection tests share."""

from __future__ import annotations

import torch

from tandem.contexts import ForwardContext, set_forward_context
from tandem.models.deepseek_config import DeepseekConfig
from tandem.models.mla import MLAttention
from tandem.models.random_deepseek import DEEPSEEK_V2_LITE
from tandem.worker import ScheduledChunk, allocate_kv_caches, build_step_inputs

BS = 4

#: (heads, kv_lora_rank, qk_nope, qk_rope, v, q_lora_rank): a small shape, and V2/V3's
#: proportions (rank 4x the nope dim, rope half of it, v = nope) with a q LoRA as V3 has.
SHAPES = {"small": (4, 32, 16, 8, 12, None), "v3_ratios": (2, 64, 16, 8, 16, 24)}

#: Steps of (new tokens, tokens already cached) per request; request r keeps its blocks
#: across steps. The last step mixes: a chunk over a cached context, two equal-length chunks
#: over different contexts (one run), a decode, a fresh prompt, and padding rows.
FRESH = [[(7, 0), (5, 0), (6, 0), (6, 0), (9, 0)]]
CHUNKED = [
    [(3, 0), (11, 0), (4, 0), (12, 0)],
    [(5, 3), (5, 11), (8, 4), (1, 12), (6, 0)],
]


def mla_config(shape: str) -> DeepseekConfig:
    heads, rank, nope, rope, v, q_lora = SHAPES[shape]
    hf = dict(DEEPSEEK_V2_LITE, hidden_size=48, num_attention_heads=heads, num_key_value_heads=heads,
              kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, q_lora_rank=q_lora)
    return DeepseekConfig.from_hf(hf, 2)


def mla_layer(cfg: DeepseekConfig, dtype: torch.dtype, mode: str = "latent", seed: int = 0) -> MLAttention:
    layer = MLAttention(cfg, dtype, kv_cache_mode=mode)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    return layer


def run_mla_steps(layer: MLAttention, steps, pad: int = 0) -> list[torch.Tensor]:
    """Each step's attention output (`attend`, before o_proj) on a fresh cache; the same
    seeded inputs whatever the layer's form or dtype."""
    requests = max(len(step) for step in steps)
    per_request = -(-max(n + c for step in steps for n, c in step) // BS)
    layer.kv_cache = allocate_kv_caches([layer.kv_cache_spec()], 1 + requests * per_request, BS)[0]
    blocks = [list(range(1 + per_request * r, 1 + per_request * (r + 1))) for r in range(requests)]
    gen = torch.Generator().manual_seed(7)
    outs = []
    for step in steps:
        chunks = [ScheduledChunk([0] * n, c, blocks[r]) for r, (n, c) in enumerate(step)]
        total = sum(n for n, _ in step)
        inputs = build_step_inputs(chunks, BS, num_tokens_padded=total + pad)
        x = torch.randn(total + pad, layer.cfg.hidden_size, generator=gen).to(layer.dtype)
        with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=inputs.attn_metadata)):
            outs.append(layer.attend(layer.prepare(inputs.positions, x)).float())
    return outs
