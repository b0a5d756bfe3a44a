"""The sampler alone: `sample_step` on random logits, sampled (temperature 1) and greedy rows.

One process times the tree it imports; put another tree first on PYTHONPATH to time that one
(its `make_sampler` may take the device first, as before `a870d3c`):

    python benchmarks/sampling_step.py --vocab 2048 --rows 1,8,32
    PYTHONPATH=/tmp/before/src python benchmarks/sampling_step.py --output /tmp/before.json

Prints the median of `--repeat` timings of `--calls` calls each, in microseconds a call, and
writes JSON (benchmarks/results/sampling_step.json unless --output).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

import torch

from tandem.worker.sampling import SamplingParams, sample_step

RESULTS = Path(__file__).resolve().parent / "results" / "sampling_step.json"


def _sampler(params: SamplingParams):
    # Trees before a870d3c made the sampler on a device: make_sampler(device, prompt, eos).
    takes_device = "device" in inspect.signature(params.make_sampler).parameters
    return params.make_sampler("cpu") if takes_device else params.make_sampler()


def time_calls(fn, calls: int, repeat: int) -> float:
    for _ in range(20):
        fn()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    rows_out = []
    print(f"sample_step, vocabulary {args.vocab}, {torch.get_num_threads()} threads; us a call, median of {args.repeat}")
    print("| rows | sampled us | greedy us |\n|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, generator=generator)
        sampled = [SamplingParams(temperature=1.0) for _ in range(rows)]
        samplers = [_sampler(p) for p in sampled]
        greedy = [SamplingParams(temperature=0.0)] * rows
        sampled_us = time_calls(lambda: sample_step(logits, sampled, samplers), args.calls, args.repeat)
        greedy_us = time_calls(lambda: sample_step(logits, greedy, [None] * rows), args.calls, args.repeat)
        rows_out.append({"rows": rows, "sampled_us": sampled_us, "greedy_us": greedy_us})
        print(f"| {rows} | {sampled_us:.0f} | {greedy_us:.0f} |")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"vocab": args.vocab, "threads": torch.get_num_threads(), "rows": rows_out}, indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
