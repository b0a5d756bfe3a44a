"""Compile tandem's Triton decode-attention kernels ahead of time for an sm_90 GPU (H100 /
H200) on a machine without one, with the ptxas that ships in the triton wheel: the
compile errors and resource limits the interpreter cannot show. Run as a module it prints
one JSON object mapping each kernel variant to its shared memory, registers and spills:
`python -m tests.support.triton_aot`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

import torch

#: name -> (page size, main dim, rope dim, value dim, dtype): what tandem launches on a GPU.
VARIANTS = {
    "mla-bf16": (16, 512, 64, 512, torch.bfloat16),  # DeepSeek-V2-Lite's latent cache
    "mla-fp32": (16, 512, 64, 512, torch.float32),
    "gqa-bf16": (16, 128, 0, 128, torch.bfloat16),
    "gqa-fp32": (16, 128, 0, 128, torch.float32),
}
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _signature(kernel, meta: dict, pointer_types: dict) -> tuple[dict, dict]:
    signature, constexprs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in meta:
            signature[name] = "constexpr"
            constexprs[(index,)] = meta[name]
        else:
            signature[name] = pointer_types.get(name, "fp32" if name == "scale" else "i32")
    return signature, constexprs


def _resources(cubin: bytes) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return {"registers": int(found[1]), "spill_stack_bytes": int(found[2])}


def compile_sm90(kernel, meta: dict, pointer_types: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {key: meta[key] for key in ("num_warps", "num_stages")}
    constants = {key: value for key, value in meta.items() if key not in options}
    signature, constexprs = _signature(kernel, constants, pointer_types)
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32), options=options
    )
    return {"shared_bytes": compiled.metadata.shared, **_resources(compiled.asm["cubin"])}


def compile_decode_attention() -> dict:
    from tandem.models import triton_decode_attention as tda

    kernels = tda._kernels(False)
    results = {}
    for name, (page, main_dim, rope_dim, value_dim, dtype) in VARIANTS.items():
        meta = tda.split_kernel_meta(page, main_dim, rope_dim, value_dim, dtype, tda.DEFAULT_KV_SPLITS, False)
        ty = _TRITON_TYPES[dtype]
        pointers = {"q_ptr": f"*{ty}", "k_ptr": f"*{ty}", "v_ptr": f"*{ty}", "block_table_ptr": "*i32",
                    "seq_lens_ptr": "*i32", "partial_ptr": "*fp32"}
        results[f"split/{name}"] = compile_sm90(kernels.decode_split, meta, pointers)
        merge_pointers = {"partial_ptr": "*fp32", "seq_lens_ptr": "*i32", "out_ptr": f"*{ty}"}
        results[f"merge/{name}"] = compile_sm90(kernels.merge_splits, tda.merge_kernel_meta(meta), merge_pointers)
    return results


if __name__ == "__main__":
    print(json.dumps(compile_decode_attention()))
