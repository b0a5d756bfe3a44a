"""Greedy tokens on CUDA (float32; eager, DBO, full graphs, DBO + full graphs) against the
CPU's float32 tokens for the same prompts: `tandem generate`'s code path, in-process, one
rank. Exit 0 when every CUDA mode gives the CPU's tokens, 1 otherwise, 2 without CUDA.

    python benchmarks/cuda_vs_cpu_tokens.py [--model small-moe] [--max-tokens 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The quick brown fox", "Mixture of experts", "One two three four five six", "GPU", "tandem overlaps"]
DBO = {"enable_dbo": True, "dbo_decode_token_threshold": 0, "dbo_prefill_token_threshold": 0}
CUDA_MODES = {  # eager says so: `--graph-mode auto`, the default, is graphs on CUDA
    "eager": {"graph_mode": "none"}, "dbo": {**DBO, "graph_mode": "none"},
    "graphs": {"graph_mode": "full"}, "dbo+graphs": {**DBO, "graph_mode": "full"},
}


def tokens(model: str, device: str, moe_backend: str, overlap: dict, max_tokens: int) -> list[list[int]]:
    from tandem.config import EngineConfig, OverlapConfig, ParallelConfig
    from tandem.engine.offline import generate_on_rank
    from tandem.worker.sampling import SamplingParams

    config = EngineConfig(
        model=model, device=device, dtype="float32", overlap=OverlapConfig(**overlap),
        parallel=ParallelConfig(all2all_backend="local", moe_backend=moe_backend),
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    completions = sorted(generate_on_rank(0, 1, config, PROMPTS, params), key=lambda c: c.index)
    return [list(c.token_ids) for c in completions]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small-moe")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--moe-backend", default="triton", help="the CUDA runs' experts (the CPU runs torch's)")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "cuda_vs_cpu_tokens.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_vs_cpu_tokens.py needs a CUDA GPU; none is available here", file=sys.stderr)
        return 2
    reference = tokens(args.model, "cpu", "torch", {}, args.max_tokens)
    results = {}
    for mode, overlap in CUDA_MODES.items():
        got = tokens(args.model, "cuda", args.moe_backend, overlap, args.max_tokens)
        same = sum(a == b for a, b in zip(got, reference))
        results[mode] = {"prompts_equal": same, "prompts": len(PROMPTS), "tokens": got}
        print(f"cuda {mode:<11} float32: {same}/{len(PROMPTS)} prompts give the CPU's greedy tokens")
    out = {"model": args.model, "device": torch.cuda.get_device_name(), "cpu_tokens": reference, "cuda": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(r["prompts_equal"] == len(PROMPTS) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
