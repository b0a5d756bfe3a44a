"""Decode attention over the paged KV cache: the torch gather path against the Triton
split-KV kernels, as the block table's width grows past the tokens actually cached.

One decode batch (`--requests` requests of `--context` cached tokens, block size 16) per
shape: `mla` is DeepSeek-V2-Lite's absorbed latent cache (16 heads over one 512 + 64 row),
`gqa` a 32/4-head cache of 128-wide rows. For each table width (`--widths` in blocks; 256 is
what a full CUDA graph keeps at max_model_len 4096) it times `_decode_attention` (gathers
every slot of the table, float32) and, on CUDA, `triton_decode_attention` (reads each
request's blocks in place, stops at `seq_len`). Times are medians of `--repeat` calls after a
warm-up (CUDA events on a GPU, wall time on CPU); "GB/s" is the cache bytes the batch really
owns (requests x context x row bytes) over the time. On CPU the Triton kernels run only
under the interpreter, which is no benchmark: the table then shows the torch path alone.

    python benchmarks/decode_attention.py                       # cuda if present, else cpu
    python benchmarks/decode_attention.py --device cpu --requests 16 --repeat 3

Writes benchmarks/results/decode_attention_{cpu,cuda}.json (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tandem.models.paged_attention import AttentionMetadata, _decode_attention

BLOCK = 16
#: (query heads, kv heads, key dim, value dim, V is K's prefix)
SHAPES = {"mla": (16, 1, 576, 512, True), "gqa": (32, 4, 128, 128, False)}


def decode_batch(shape: str, requests: int, context: int, width: int, dtype, device):
    heads, kv_heads, key_dim, value_dim, shared = SHAPES[shape]
    blocks_each = -(-context // BLOCK)
    g = torch.Generator(device=device).manual_seed(0)
    k_cache = torch.randn(1 + requests * blocks_each, BLOCK, kv_heads, key_dim, generator=g, device=device).to(dtype)
    v_cache = k_cache[..., :value_dim] if shared else torch.randn_like(k_cache[..., :value_dim])
    table = torch.zeros(requests, width, dtype=torch.int32, device=device)
    table[:, :blocks_each] = 1 + torch.arange(requests * blocks_each, device=device, dtype=torch.int32).view(requests, -1)
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(requests + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((requests,), context, dtype=torch.int32, device=device), max_query_len=1,
        slot_mapping=torch.zeros(requests, dtype=torch.int64, device=device), block_table=table, block_size=BLOCK,
        decode_only=True,
    )
    query = torch.randn(requests, heads, key_dim, generator=g, device=device).to(dtype)
    row_bytes = (key_dim + (0 if shared else value_dim)) * kv_heads * k_cache.element_size()
    return query, k_cache, v_cache, metadata, requests * context * row_bytes


def median_ms(fn, repeat: int, device: torch.device) -> float:
    fn()  # warm-up: Triton compiles here
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    for shape in args.shapes.split(","):
        for width in (int(w) for w in args.widths.split(",")):
            query, k_cache, v_cache, metadata, real_bytes = decode_batch(
                shape, args.requests, args.context, width, dtype, device)
            scale = query.shape[-1] ** -0.5
            row = {"shape": shape, "width_blocks": width, "real_bytes": real_bytes}
            row["torch_ms"] = median_ms(lambda: _decode_attention(query, k_cache, v_cache, metadata, scale),
                                        args.repeat, device)
            if device.type == "cuda":
                from tandem.models.triton_decode_attention import triton_decode_attention

                row["triton_ms"] = median_ms(lambda: triton_decode_attention(
                    query, k_cache, v_cache, metadata.seq_lens, metadata.block_table, scale), args.repeat, device)
            rows.append(row)
    return rows


def print_table(rows: list[dict], header: str) -> None:
    print(header)
    print(f"{'shape':<6} {'table':>6} {'torch ms':>9} {'GB/s':>7} {'triton ms':>10} {'GB/s':>7} {'speed-up':>9}")
    for r in rows:
        gbps = lambda ms: r["real_bytes"] / ms / 1e6  # noqa: E731
        triton = r.get("triton_ms")
        tail = f"{triton:>10.3f} {gbps(triton):>7.2f} {r['torch_ms'] / triton:>8.1f}x" if triton else f"{'n/a':>10}"
        print(f"{r['shape']:<6} {r['width_blocks']:>6} {r['torch_ms']:>9.3f} {gbps(r['torch_ms']):>7.2f} {tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--shapes", default="mla,gqa")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--widths", default="16,256")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", default=None, help="default benchmarks/results/decode_attention_{cpu,cuda}.json")
    args = parser.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = (f"device {name}, {dtype}, {args.requests} requests x {args.context} cached tokens, "
              f"block {BLOCK}, median of {args.repeat}")
    rows = measure(args, device, dtype)
    print_table(rows, header)
    out = Path(args.out or f"benchmarks/results/decode_attention_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args) | {"device": name, "dtype": str(dtype)}, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
