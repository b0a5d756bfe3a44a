"""What constrained decoding costs a decode step (`tandem.worker.grammar`), in one run:

- `mask`: the per-step grammar work alone — fill the token bitmask of R constrained rows on
  the host, copy it to the logits' device, mask the logits — median over steps;
- `engine`: tiny-moe decode through the `Engine` (overlapped loop) with R requests of which a
  share is constrained to a JSON schema (a bounded object, then free text would follow the
  end), the rest free (`ignore_eos`): seconds per generated token, median of --runs,
  configurations interleaved. The 0 % row is the baseline: requests without a constraint
  take no grammar path at all.

The tokenizer is tiny-moe's byte tokenizer (258 tokens): the bitmask fill grows with the
vocabulary, so a 150k-vocabulary model pays more per row than this.

    python benchmarks/structured_output.py [--rows 8 32] [--runs 5] [--tokens 48] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

SCHEMA = json.dumps({
    "type": "array", "minItems": 40,
    "items": {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["k"]},
})


def mask_step_s(rows: int, steps: int) -> float:
    from tandem.models.tiny_moe import EOS_ID, build_tokenizer
    from tandem.worker.grammar import GrammarCompiler, mask_logits

    compiler = GrammarCompiler(build_tokenizer(), [EOS_ID])
    constraints = [compiler.constraint(SCHEMA) for _ in range(rows)]
    logits = torch.randn(rows, 320)
    times = []
    for _ in range(steps):
        work = logits.clone()
        start = time.perf_counter()
        mask_logits(work, list(range(rows)), constraints)
        times.append(time.perf_counter() - start)
        for c, token in zip(constraints, work.argmax(-1).tolist()):
            c.advance(token)
    return statistics.median(times)


def engine_s_per_token(rows: int, constrained_share: float, tokens: int) -> float:
    from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.build import build_engine
    from tandem.worker.sampling import SamplingParams

    config = EngineConfig(
        model="tiny-moe", device="cpu", cache=CacheConfig(num_kv_blocks=rows * 8 + 8, block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=rows, overlap_schedule=True), max_num_batched_tokens=4096,
    )
    engine = build_engine(config)
    info = engine.runner.info
    constrained = round(rows * constrained_share)
    for i in range(rows):
        schema = SCHEMA if i < constrained else None
        # The schema needs more than `tokens` tokens: every request generates exactly `tokens`.
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, json_schema=schema)
        engine.add_request(f"r{i}", info.tokenizer.encode(f"request {i}").ids, params)
    generated = 0
    engine.step()  # the prefill: not what is measured
    start = time.perf_counter()
    while engine.has_work:
        generated += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    engine.close()
    return elapsed / max(generated, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "structured_output.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shares = (0.0, 0.5, 1.0)
    results = {"host": platform.node(), "torch_threads": 1, "tokens": args.tokens, "mask": {}, "engine": {}}
    print(f"{'rows':>5} {'mask step (us)':>15}")
    for rows in args.rows:
        results["mask"][rows] = mask_step_s(rows, 200)
        print(f"{rows:>5} {results['mask'][rows] * 1e6:>15.1f}")
    print(f"\n{'rows':>5} {'constrained':>12} {'ms / token':>11} {'vs 0 %':>7}")
    for rows in args.rows:
        samples = {share: [] for share in shares}
        for _ in range(args.runs):
            for share in shares:  # interleaved: load drifts hit every configuration alike
                samples[share].append(engine_s_per_token(rows, share, args.tokens))
        base = statistics.median(samples[0.0])
        for share in shares:
            value = statistics.median(samples[share])
            results["engine"].setdefault(rows, {})[f"{share:.0%}"] = value
            print(f"{rows:>5} {share:>12.0%} {value * 1e3:>11.3f} {value / base:>6.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
