"""One model's decode step in two source trees (a commit before a change, and now), run in
alternating processes, so a before/after ratio comes from one sitting on a drifting machine.

Each process loads the checkpoint as `serve` does (`load_model`), prefills `--batch` prompts of
`--prompt-len` tokens through `GreedyHarness` (paged KV cache, the engine's step inputs), then
times `--steps` decode steps; the median of the last `--steps - 5` is its figure. The table
gives the median over `--rounds` processes per tree and the ratio (before / after: > 1, the
change made it faster).

    git worktree add /tmp/before 3e34fd0
    python benchmarks/decode_step_ab.py --before /tmp/before/src \\
        --models build/vs_vllm_models/mixtral:float32,build/vs_vllm_models/qwen3_moe_h1024:bfloat16 --batches 1,32

Results go to benchmarks/results/decode_step_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "decode_step_ab.json"

_CHILD = """
import statistics, sys, time, torch
from tandem.models.loader import load_model
from tandem.testing.model_harness import GreedyHarness
model, dtype, batch, prompt, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_grad_enabled(False)
info = load_model(model, device="cpu", dtype=getattr(torch, dtype))
harness = GreedyHarness(info.model, num_blocks=batch * ((prompt + steps) // 16 + 2) + 1, block_size=16)
sequences = [{"tokens": list(range(2, 2 + prompt)), "computed": 0} for _ in range(batch)]
harness.step(sequences)
times = []
for _ in range(steps):
    for s in sequences:
        s["tokens"].append(5)
    start = time.perf_counter()
    harness.step(sequences)
    times.append(time.perf_counter() - start)
print(1000 * statistics.median(times[5:]))
"""


def step_ms(src: str, model: str, dtype: str, batch: int, prompt: int, steps: int) -> float:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", _CHILD, model, dtype, str(batch), str(prompt), str(steps)],
                         env=env, capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the `src` directory of the earlier tree")
    parser.add_argument("--after", default=str(ROOT / "src"), help="the `src` directory of the later tree (this one)")
    parser.add_argument("--models", required=True, help="comma-separated MODEL:DTYPE")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=45)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    print("| model | dtype | batch | before ms | after ms | before / after |\n|---|---|---|---|---|---|")
    for spec in args.models.split(","):
        model, _, dtype = spec.partition(":")
        for batch in (int(b) for b in args.batches.split(",")):
            before, after = [], []
            for _ in range(args.rounds):
                before.append(step_ms(args.before, model, dtype or "float32", batch, args.prompt_len, args.steps))
                after.append(step_ms(args.after, model, dtype or "float32", batch, args.prompt_len, args.steps))
            b, a = statistics.median(before), statistics.median(after)
            rows.append({"model": model, "dtype": dtype, "batch": batch, "before_ms": before, "after_ms": after})
            print(f"| {Path(model).name} | {dtype} | {batch} | {b:.2f} | {a:.2f} | {b / a:.2f}x |", flush=True)
    args.output.write_text(json.dumps({"before": args.before, "after": args.after, "prompt_len": args.prompt_len,
                                       "steps": args.steps, "rows": rows}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
