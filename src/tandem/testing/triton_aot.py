"""Ahead-of-time compile of every Triton kernel tandem launches, for an sm_90 GPU (H100 /
H200), on a machine with no GPU: the compile errors, lowering failures and resource limits
the interpreter never shows, under whichever Triton is installed (the GPU image's 3.6, the
newest), before a lent GPU's minutes are spent finding them.

What to compile comes from a launch manifest: the fake-CUDA job runs tandem's real CUDA
paths (decode and prefill steps of the DeepSeek-V2-Lite and Qwen3-30B-A3B shapes, the
masked experts) and records each launch as `describe` writes it: the kernel, the dtype of
each tensor, each constexpr exactly, and each other integer only as the class Triton
specialises on (1, a multiple of 16, anything else). Triton's own `warmup` then compiles each
entry against a stand-in driver that reports an sm_90 target, so the signature, constants and
alignment attributes are the ones the runtime would derive.

    python -m tandem.testing.triton_aot tests/fakecuda/triton_launches.json
    PYTHONPATH=build/triton36 python -m tandem.testing.triton_aot tests/fakecuda/triton_launches.json

prints one JSON object: each entry's shared memory, registers and spills, or its error; the
exit status is 1 when any entry failed to compile or needs more shared memory than a block
may have.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

#: The most shared memory one block may use on an H100 / H200 (227 KiB).
SM90_SHARED_LIMIT = 227 * 1024


def _integer_class(value: int) -> int:
    """A stand-in with the specialisation `value` gets (Triton keys a compiled kernel on
    whether an int is 1, divisible by 16, or needs 64 bits, never on the value)."""
    if value == 1:
        return 1
    stand_in = 16 if value % 16 == 0 else 3
    return stand_in + (1 << 32 if abs(value) >= 1 << 31 else 0)


def _runtime_arg(value: Any, constexpr: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch.")}
    if constexpr or value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return _integer_class(value)
    if isinstance(value, float):
        return 0.5  # floats are never specialised
    raise TypeError(f"a Triton launch argument of type {type(value).__name__} cannot be described")


def describe(kernel, args: tuple, kwargs: dict) -> dict:
    """One launch of the JIT function `kernel` as a manifest entry (JSON-able, and equal for
    two launches that compile to the same binary)."""
    constexpr = [param.is_constexpr for param in kernel.params]
    names = [param.name for param in kernel.params]
    described = {"kernel": f"{kernel.fn.__module__}:{kernel.fn.__qualname__}"}
    described["args"] = [_runtime_arg(value, constexpr[i]) for i, value in enumerate(args)]
    described["kwargs"] = {
        name: _runtime_arg(value, name not in names or constexpr[names.index(name)])
        for name, value in sorted(kwargs.items())
    }
    return described


def kernel_name(entry: dict) -> str:
    return entry["kernel"].split(":")[1].rsplit(".", 1)[-1]


def label(entry: dict) -> str:
    """A short readable name: kernel, tensor dtypes, constexprs."""
    name = kernel_name(entry)
    dtypes = sorted({a["tensor"] for a in [*entry["args"], *entry["kwargs"].values()] if isinstance(a, dict)})
    meta = ",".join(f"{k}={v}" for k, v in entry["kwargs"].items() if not isinstance(v, dict))
    return f"{name}[{'/'.join(dtypes)}]({meta})"


def find_kernel(reference: str):
    """The JIT function a manifest entry names (`module:qualname`), defined compiled (not
    interpreted) the way the module defines it."""
    from tandem.platform import triton_utils

    module_name, qualname = reference.split(":")
    module = importlib.import_module(module_name)
    namespaces = []
    if hasattr(module, "_kernels"):
        namespaces.append(module._kernels(False))
    if hasattr(module, "_define"):
        namespaces.append(triton_utils._defined(module._define, False))
    for namespace in namespaces:
        for kernel in vars(namespace).values():
            if getattr(getattr(kernel, "fn", None), "__qualname__", None) == qualname:
                return kernel
    raise LookupError(f"{reference}: no such Triton kernel (the manifest is older than the code: regenerate it)")


class _Sm90Driver:
    """What `JITFunction.run(warmup=True)` asks of the active driver, for an H100/H200."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextmanager
def sm90_target() -> Iterator[None]:
    from triton.runtime import driver

    driver.set_active(_Sm90Driver())
    try:
        yield
    finally:
        try:
            driver.reset_active()
        except RuntimeError:  # no GPU driver here: nothing else could use one anyway
            pass


def _resources(cubin: bytes) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return {"registers": int(found[1]), "spill_stack_bytes": int(found[2])}


def _value(described: Any) -> Any:
    if isinstance(described, dict) and "tensor" in described:
        return getattr(torch, described["tensor"])  # `warmup` stands a mock tensor in for a dtype
    return described


def compile_entry(entry: dict) -> dict:
    """Compile one manifest entry for sm_90 (inside `sm90_target`); its resource usage."""
    kernel = find_kernel(entry["kernel"])
    args = [_value(a) for a in entry["args"]]
    kwargs = {name: _value(v) for name, v in entry["kwargs"].items()}
    compiled = kernel.warmup(*args, grid=(1,), **kwargs)
    return {"shared_bytes": compiled.metadata.shared, **_resources(compiled.asm["cubin"])}


def compile_manifest(entries: list[dict]) -> dict[str, dict]:
    """Every entry compiled; `{label: usage}`, or `{label: {"error": text}}` for a failure
    (all entries are tried, so one report names every failure)."""
    results = {}
    with sm90_target():
        for entry in entries:
            try:
                results[label(entry)] = compile_entry(entry)
            except Exception as error:  # noqa: BLE001 - reported per entry, the rest still compile
                results[label(entry)] = {"error": f"{type(error).__name__}: {str(error)[-1500:]}"}
    return results


def failures(results: dict[str, dict]) -> dict[str, str]:
    bad = {}
    for name, usage in results.items():
        if "error" in usage:
            bad[name] = usage["error"]
        elif usage["shared_bytes"] > SM90_SHARED_LIMIT:
            bad[name] = f"{usage['shared_bytes']} bytes of shared memory, over sm_90's {SM90_SHARED_LIMIT}"
    return bad


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        return 2
    import triton

    entries = json.loads(Path(argv[0]).read_text())["launches"]
    results = compile_manifest(entries)
    print(json.dumps({"triton": triton.__version__, "results": results}))
    bad = failures(results)
    for name, why in bad.items():
        print(f"{name}: {why}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
