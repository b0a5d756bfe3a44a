"""The compiled step: `torch.compile` (inductor) over a model's decoder stack, with attention
and the MoE layers as opaque custom ops (`tandem.models.opaque_ops`).

What inductor gets: the embedding, norms, projections, residual adds and activations between
the opaque ops, as one graph per model (the whole stage, as vLLM compiles it: each op carries
its layer's name, so one layer's graph would not serve the next). It fuses the element-wise
work; the CPU projections stay tandem's packed GEMMs (`tandem::cpu_linear`). The token dimension is
dynamic: a step of one token has a graph of its own (dynamo specialises size 1), every larger
step shares one symbolic graph, so `warm_up` compiles both and serving never recompiles;
`CompiledModel.graphs` counts what the backend compiled, and tests and benchmarks check it.

The compile cache is inductor's own (FX graph and AOT caches), kept in a directory keyed by
the model, the dtype and device, torch's version and tandem's source (`cache_dir_for`): a
second start of the same configuration skips code generation.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from tandem.models.opaque_ops import register_opaque
from tandem.platform.compile_support import allow_many_compiled_models, below_autograd

#: Where compile caches go unless TANDEM_COMPILE_CACHE names a directory.
DEFAULT_CACHE_ROOT = Path.home() / ".cache" / "tandem" / "compile"


def compile_default(device: torch.device, dtype: torch.dtype) -> bool:
    """`--compile auto`: on for bfloat16 on the CPU, off otherwise, as measured. On the CPU,
    `tandem serve` of the hidden-1024 Qwen3-MoE against vLLM (`benchmarks/vs_vllm.py`, three
    rounds each, with tandem's CPU kernels behind the opaque ops) gave 1.19 / 1.17 / 0.90x
    vLLM's output tok/s at c = 1 / 8 / 32 compiled in bfloat16 against 0.82 / 1.06 / 0.92x
    eager, for a ~20 s first start (~9 s from the compile cache); in float32 the compiled and
    eager engine steps measure alike (`benchmarks/compiled_step.py`: 0.98-1.03x), so float32
    keeps eager's 4 s start. On CUDA nothing is measured yet: a GPU run decides it against
    eager and full graphs."""
    return device.type == "cpu" and dtype == torch.bfloat16


def resolve_compile(mode: str, device: torch.device, dtype: torch.dtype, *, greenlet_ubatches: bool = False) -> bool:
    """Whether the step runs compiled, for a `mode` EngineConfig has checked. Never with
    greenlet ubatches (EngineConfig refuses `on`; `auto` turns off): their switch inside the
    MoE op would cross the dispatcher's C++ frames."""
    if greenlet_ubatches:
        return False
    return compile_default(device, dtype) if mode == "auto" else mode == "on"


def inductor_patches(device: torch.device) -> dict:
    """Inductor settings of the compiled step on `device`. On the CPU the graph's wrapper (the
    code that allocates buffers and calls each kernel and opaque op in turn) is C++ rather
    than Python: a decode step of the hidden-1024 Qwen3-MoE in bfloat16 took 0.96-0.97x the
    time at batch 1, 8 and 32 (`benchmarks/compiled_step.py`), the wrapper's Python being a
    tenth of a batch-1 step. On CUDA the default stands until a GPU measures it."""
    return {"cpp_wrapper": True} if device.type == "cpu" else {}


def _source_digest() -> str:
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_dir_for(model: nn.Module, dtype: torch.dtype, device: torch.device) -> Path:
    """The compile cache of this model configuration: its directory name hashes the model's
    config, the dtype, the device type, torch's version and tandem's source."""
    config = getattr(model, "config", None)
    described = config.to_dict() if hasattr(config, "to_dict") else vars(config) if config is not None else {}
    key = json.dumps(
        {
            "model": type(model).__name__,
            "config": described,
            "stage": repr(getattr(model, "stage", None)),
            "dtype": str(dtype),
            "device": device.type,
            "torch": torch.__version__,
            "tandem": _source_digest(),
        },
        sort_keys=True,
        default=repr,
    )
    root = Path(os.environ.get("TANDEM_COMPILE_CACHE", DEFAULT_CACHE_ROOT))
    return root / hashlib.sha256(key.encode()).hexdigest()[:20]


class CompiledModel:
    """Compiles `model`'s forward in place (the instance's `forward` becomes the compiled one):
    `model(...)` runs the compiled step, the TBO operation lists and everything else keep calling the eager
    modules, whose attention and MoE layers now dispatch through the opaque ops."""

    def __init__(self, model: nn.Module, *, cache_dir: Path | None = None, backend: str = "inductor"):
        """`backend`: inductor, or another dynamo backend by name (tests check the op
        boundary with `aot_eager`, which generates no code)."""
        self.backend = backend
        #: Graphs the backend compiled (dynamo's first trace and every recompile).
        self.graphs = 0
        self.config_patches = inductor_patches(next(model.parameters()).device)
        self.cache_dir = cache_dir
        for name, module in model.named_modules():
            if hasattr(module, "attend") or hasattr(module, "moe_forward"):
                register_opaque(module, name)
        if cache_dir is not None:
            cache_dir.mkdir(parents=True, exist_ok=True)
            # Inductor reads it when it compiles, and every process compiles its own model.
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
        allow_many_compiled_models()
        compiled = torch.compile(model.forward, backend=self._backend, fullgraph=True, dynamic=None)

        def forward(*args, **kwargs):
            # Grad mode and the dispatch keys are per thread, and dynamo guards on both: a
            # ubatch's worker thread must see what the start-up compile saw.
            with torch.no_grad(), below_autograd():
                return compiled(*args, **kwargs)

        model.forward = forward

    @classmethod
    def for_config(cls, model: nn.Module, config, device: torch.device) -> "CompiledModel | None":
        """The compiled step `config` (an EngineConfig, or None: eager) asks for on `device`."""
        if config is None or not resolve_compile(config.compile, device, model.dtype,
                                                 greenlet_ubatches=config.overlap.greenlet_ubatches):
            return None
        return cls(model, cache_dir=cache_dir_for(model, model.dtype, device))

    def _backend(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        if self.backend != "inductor":
            return torch._dynamo.lookup_backend(self.backend)(graph_module, example_inputs)
        return compile_fx(graph_module, example_inputs, config_patches=self.config_patches)

    @contextlib.contextmanager
    def compiling(self):
        """Around the start-up steps that compile: says so, and how long it took."""
        started = time.perf_counter()
        print(f"[tandem] compiling the model step (cache {self.cache_dir}) ...", file=sys.stderr, flush=True)
        yield
        print(f"[tandem] compiled the model step: {self.graphs} graphs in {time.perf_counter() - started:.1f} s",
              file=sys.stderr, flush=True)


__all__ = ["CompiledModel", "cache_dir_for", "compile_default", "inductor_patches", "resolve_compile"]
