"""`output_tok_s`: one engine's output tokens per second over a fixed batch of requests, the
loop the throughput benchmarks (`benchmarks/engine_tok_s.py`, `benchmarks/gpu.py`) time."""

from __future__ import annotations

import time

import torch


def output_tok_s(engine, *, requests: int, prompt_len: int, max_tokens: int, seed: int, lowest_token: int = 2) -> float:
    """Add `requests` random prompts (token ids in `[lowest_token, 250)`, from `seed`) that
    each generate exactly `max_tokens` greedy tokens, run `engine` until it has no work, close
    it, and return generated tokens / wall seconds from the first step to the last output."""
    from tandem.worker.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(requests):
        engine.add_request(f"r{i}", torch.randint(lowest_token, 250, (prompt_len,), generator=g).tolist(), params)
    start = time.perf_counter()
    generated = 0
    while engine.has_work:
        generated += sum(len(o.new_token_ids) for o in engine.step())
    generated += sum(len(o.new_token_ids) for o in engine.drain())
    elapsed = time.perf_counter() - start
    engine.close()
    if generated != requests * max_tokens:
        raise RuntimeError(f"generated {generated} tokens, expected {requests * max_tokens}")
    return generated / elapsed


__all__ = ["output_tok_s"]
