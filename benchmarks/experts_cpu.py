"""The standard-layout torch experts (`TorchExperts.apply`) on CPU at the hidden-1024 Qwen3-MoE's
shapes (16 experts, top-2, hidden 1024, expert width 512), float32 and bf16, at decode batch
sizes; optionally against another checkout's `experts_torch.py` (e.g. the per-expert loop
this replaced):

    git archive 5e96690 src | tar -x -C /tmp/base
    python benchmarks/experts_cpu.py --baseline /tmp/base/src --threads 1 --json benchmarks/results/experts_cpu.json

Times are this process's CPU time (`time.process_time`), medians of `--repeats` calls: with
`--threads 1` that is the work done, steady on a shared machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from tandem.modular_kernels import ExpertTokens, TorchExperts

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 16, 1024, 512, 2


def load_baseline(src: Path):
    path = src / "tandem" / "modular_kernels" / "experts_torch.py"
    spec = importlib.util.spec_from_file_location("baseline_experts_torch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TorchExperts()


def cpu_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,32")
    parser.add_argument("--baseline", type=Path, help="another checkout's src/ whose TorchExperts to time too")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    impls = {"this": TorchExperts()} | ({"baseline": load_baseline(args.baseline)} if args.baseline else {})
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        w1 = (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) * HIDDEN**-0.5).to(dtype)
        w2 = (torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=g) * INTERMEDIATE**-0.5).to(dtype)
        for n in [int(t) for t in args.tokens.split(",")]:
            ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(n)])
            tokens = ExpertTokens(torch.randn(n, HIDDEN, generator=g).to(dtype), None, dtype, topk_ids=ids,
                                  topk_weights=torch.rand(n, TOP_K, generator=g))
            row = {"dtype": str(dtype).removeprefix("torch."), "tokens": n}
            for name, impl in impls.items():
                row[f"{name}_ms"] = cpu_ms(lambda: impl.apply(tokens, w1, w2), args.repeats)
            rows.append(row)
    names = list(impls)
    print(f"TorchExperts.apply, {EXPERTS} experts top-{TOP_K}, H={HIDDEN}, I={INTERMEDIATE}, "
          f"{torch.get_num_threads()} threads, CPU ms (median of {args.repeats})\n")
    print("| dtype | tokens | " + " | ".join(names) + (" | baseline / this |" if args.baseline else " |"))
    print("|---|---|" + "---|" * (len(names) + bool(args.baseline)))
    for row in rows:
        cells = [f"{row[f'{name}_ms']:.2f}" for name in names]
        ratio = [f"{row['baseline_ms'] / row['this_ms']:.2f}x"] if args.baseline else []
        print(f"| {row['dtype']} | {row['tokens']} | " + " | ".join(cells + ratio) + " |")
    if args.json:
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
