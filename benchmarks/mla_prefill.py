"""One DeepSeek-V2-Lite-shaped MLA layer's prefill (attention dims of V2-Lite: 16 heads,
kv_lora_rank 512, qk 128 + 64, v 128, hidden 2048; seeded random weights) in the absorbed
(latent) form against the per-head form (gpu-review-3 G3), alternating in one process: a
fresh prompt of `--tokens`, and a chunk of `--tokens` after `--context` cached tokens. Each
form is forced through `mla_prefill.per_head_pays`; the model's own choice is printed beside.

    python benchmarks/mla_prefill.py                                   # CPU, bf16 and fp32
    python benchmarks/mla_prefill.py --device cuda --dtype bfloat16 --tokens 2048 --context 2048

On CUDA it also says which SDPA backends take each form's shapes (flash / mem-efficient /
cuDNN / math, each tried alone). Best of `--repeat`; the layer's forward includes the
projections, which both forms share.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from tandem.contexts import ForwardContext, set_forward_context
from tandem.models import mla_prefill
from tandem.models.deepseek_config import DeepseekConfig
from tandem.models.mla import MLAttention
from tandem.models.random_deepseek import DEEPSEEK_V2_LITE
from tandem.worker import BlockAllocator, ScheduledChunk, allocate_kv_caches, build_step_inputs

BLOCK = 16
REAL_RULE = mla_prefill.per_head_pays


def _layer(cfg: DeepseekConfig, dtype: torch.dtype, device: str, blocks: int) -> MLAttention:
    torch.manual_seed(0)
    layer = MLAttention(cfg, dtype).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            fill = torch.randn(p.shape) * p.shape[-1] ** -0.5 if p.dim() > 1 else 1 + 0.1 * torch.randn(p.shape)
            p.copy_(fill)
    layer.kv_cache = allocate_kv_caches([layer.kv_cache_spec()], blocks, BLOCK, device=device)[0]
    return layer


def _time(layer, inputs, x, form: str, device: str) -> float:
    mla_prefill.per_head_pays = lambda *args: form == "per_head"
    try:
        with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=inputs.attn_metadata)):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            layer(inputs.positions, x)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start
    finally:
        mla_prefill.per_head_pays = REAL_RULE


def _backends(cfg: DeepseekConfig, dtype: torch.dtype, tokens: int) -> dict:
    """Which SDPA backends run each form's causal prefill shapes, each allowed alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    nh, rank, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    shapes = {
        "per_head": ((nh, cfg.qk_head_dim), (nh, cfg.qk_head_dim), (nh, cfg.v_head_dim)),
        "latent": ((nh, rank + rope), (1, rank + rope), (1, rank)),
    }
    found = {}
    for form, dims in shapes.items():
        q, k, v = (torch.randn(1, h, tokens, d, dtype=dtype, device="cuda") for h, d in dims)
        found[form] = []
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.MATH):
            try:
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=form == "latent")
                found[form].append(backend.name)
            except RuntimeError:
                pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16,float32")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cfg = DeepseekConfig.from_hf(dict(DEEPSEEK_V2_LITE), 2)
    per_request = -(-(args.tokens + args.context) // BLOCK)
    rows = []
    for dtype in (getattr(torch, name) for name in args.dtype.split(",")):
        layer = _layer(cfg, dtype, args.device, per_request + 1)
        blocks = BlockAllocator(per_request + 1).allocate(per_request)
        x = torch.randn(args.tokens, cfg.hidden_size, dtype=dtype, device=args.device)
        cases = [("prefill", ScheduledChunk([0] * args.tokens, 0, blocks))]
        if args.context:
            cases.append((f"chunk after {args.context}", ScheduledChunk([0] * args.tokens, args.context, blocks)))
        for name, chunk in cases:
            inputs = build_step_inputs([chunk], BLOCK, device=args.device)
            if chunk.num_computed:  # fill the context first
                context = build_step_inputs([ScheduledChunk([0] * args.context, 0, blocks)], BLOCK, device=args.device)
                _time(layer, context, torch.randn(args.context, cfg.hidden_size, dtype=dtype, device=args.device),
                      "latent", args.device)
            best = {"latent": float("inf"), "per_head": float("inf")}
            for _ in range(args.repeat + 1):  # the first round warms up
                for form in best:
                    best[form] = min(best[form], _time(layer, inputs, x, form, args.device))
            keys = args.tokens + args.context
            row = {"dtype": str(dtype).removeprefix("torch."), "case": name, "tokens": args.tokens,
                   "latent_ms": best["latent"] * 1e3, "per_head_ms": best["per_head"] * 1e3,
                   "model_takes": "per_head" if REAL_RULE(cfg, args.tokens, keys) else "latent"}
            rows.append(row)
            print(f"{row['dtype']:9} {name:18} {args.tokens} tokens: latent {row['latent_ms']:8.1f} ms, "
                  f"per head {row['per_head_ms']:8.1f} ms ({best['latent'] / best['per_head']:.2f}x); "
                  f"the model takes {row['model_takes']}", flush=True)
        if args.device == "cuda":
            print("SDPA backends:", _backends(cfg, dtype, args.tokens), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
