"""Where one prefill and one decode step of a model spend their time, per module, against
the roofline measured in the same run: `tandem profile` with the benchmark's defaults
(the DeepSeek-V2-Lite shape on a GPU, tiny-moe on the CPU), table to stdout, JSON to
benchmarks/results/profile_step_<device>.json (profile_step_cpu.json or profile_step_cuda.json).

    python benchmarks/profile_step.py                                  # auto device
    python benchmarks/profile_step.py --model deepseek-v2-lite-random --device cuda \
        --batch 64 --prompt-len 128 --moe-backend triton
    python benchmarks/profile_step.py --model build/vs_vllm_models/qwen3_moe_h1024 --device cpu --batch 8

Every other `tandem profile` flag passes through (see `tandem profile --help`).
"""

from __future__ import annotations

import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str]) -> None:
    import torch

    from tandem.cli import app

    device = argv[argv.index("--device") + 1] if "--device" in argv[:-1] else "auto"
    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    defaults = {
        "--model": "deepseek-v2-lite-random" if on_gpu else "tiny-moe",
        "--batch": "64" if on_gpu else "8",
        "--prompt-len": "128" if on_gpu else "32",
        "--moe-backend": "triton" if on_gpu else "torch",
        "--json": str(RESULTS / f"profile_step_{'cuda' if on_gpu else 'cpu'}.json"),
    }
    args = list(argv)
    for flag, value in defaults.items():
        if flag not in args:
            args += [flag, value]
    app(["profile", *args], standalone_mode=True)


if __name__ == "__main__":
    main(sys.argv[1:])
