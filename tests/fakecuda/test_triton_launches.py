"""The launch manifest (`triton_launches.json`): every distinct Triton launch tandem's CUDA
paths make, recorded on fake CUDA tensors, for `tandem.testing.triton_aot` to compile for
sm_90 under each Triton the project supports (the main suite's `test_triton_sm90.py`).

The runs cover each kernel in every tile and dtype a GPU run takes: decode and prefill steps
of the DeepSeek-V2-Lite and Qwen3-30B-A3B shapes in bfloat16 (prefills of 256 and 1,024
tokens reach the grouped GEMM's wider tiles; decode batches of 8 to 256 requests each KV
split count), float32 decode steps, the masked experts
DeepEP's low-latency dispatch feeds, and the pair sum without the shared experts' output
(where they run after the routed ones). When the code launches something the committed manifest
lacks (or no longer launches an entry), the test rewrites the file and fails: commit it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.fakecuda.harness import FAKECUDA_MARKS  # noqa: E402

pytestmark = FAKECUDA_MARKS

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from tests.fakecuda import harness  # noqa: E402

MANIFEST = Path(__file__).with_name("triton_launches.json")
BLOCK = 16

#: (shape, dtype, chunks of (new tokens, cached tokens)) run as one step each.
STEPS = [
    ("deepseek-v2-lite", torch.bfloat16, harness.decode_chunks(8, 20)),
    # Larger decode batches take fewer KV splits (`kv_splits_for`): 4, 2 and 1 here.
    ("deepseek-v2-lite", torch.bfloat16, harness.decode_chunks(64, 20)),
    ("deepseek-v2-lite", torch.bfloat16, harness.decode_chunks(100, 20)),
    ("deepseek-v2-lite", torch.bfloat16, harness.decode_chunks(256, 20)),
    ("qwen3-moe", torch.bfloat16, harness.decode_chunks(64, 20)),
    ("deepseek-v2-lite", torch.bfloat16, [(256, 0)]),
    ("deepseek-v2-lite", torch.bfloat16, [(1024, 0)]),
    ("deepseek-v2-lite", torch.float32, harness.decode_chunks(8, 20)),
    ("qwen3-moe", torch.bfloat16, harness.decode_chunks(8, 20)),
    ("qwen3-moe", torch.bfloat16, [(1024, 0)]),
    ("qwen3-moe", torch.bfloat16, [(2048, 0)]),
    ("qwen3-moe", torch.float32, harness.decode_chunks(8, 20)),
]

#: DeepEP low-latency slots (experts, rows per expert) of the DeepSeek-V2-Lite experts.
MASKED_SLOTS = [(64, 16), (64, 128), (64, 1024)]


def _run_step(name, dtype, chunks) -> None:
    from tandem.contexts import ForwardContext, set_forward_context

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = harness.layer_shape_model(name, dtype)
        inputs = harness.step_inputs(model, chunks, BLOCK)
        with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=inputs.attn_metadata)):
            model(inputs.input_ids, inputs.positions)


def _run_masked_experts(num_experts: int, rows: int, hidden: int = 2048, intermediate: int = 1408) -> None:
    from tandem.modular_kernels.experts_triton import TritonBatchedExperts
    from tandem.modular_kernels.interfaces import ExpertTokens

    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cuda"):
        dtype = torch.bfloat16
        tokens = ExpertTokens(
            torch.empty(num_experts, rows, hidden, dtype=dtype), None, dtype,
            expert_num_tokens=torch.empty(num_experts, dtype=torch.int32),
        )  # fmt: skip
        w1 = torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype)
        w2 = torch.empty(num_experts, hidden, intermediate, dtype=dtype)
        TritonBatchedExperts().apply(tokens, w1, w2)


def _run_unfolded_pair_sums(tokens: int = 8, top_k: int = 6, hidden: int = 2048, experts: int = 64) -> None:
    """The DeepSeek-V2-Lite pair sum with no shared output to add: what DBO, SBO's
    combine-shared and TBO's prefill launch, where the shared experts run after the routed
    ones (the steps above fold it, `FusedMoEModularKernel`)."""
    from tandem.modular_kernels.pair_sum import sum_pairs

    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cuda"):
        for dtype in (torch.bfloat16, torch.float32):
            y = torch.empty(tokens * top_k, hidden, dtype=torch.float32)
            sum_pairs(y, torch.empty(tokens, top_k, dtype=torch.int64), experts, dtype)


def record_launches(monkeypatch) -> list[dict]:
    harness.use_fake_cuda_platform(monkeypatch)
    described: list[dict] = []
    harness.stub_triton(monkeypatch, described)
    for name, dtype, chunks in STEPS:
        _run_step(name, dtype, chunks)
    for num_experts, rows in MASKED_SLOTS:
        _run_masked_experts(num_experts, rows)
    _run_unfolded_pair_sums()
    distinct = {json.dumps(entry, sort_keys=True): entry for entry in described}
    return [distinct[key] for key in sorted(distinct)]


def test_the_launch_manifest_lists_every_launch(monkeypatch):
    from tandem.testing.triton_aot import kernel_name, label

    launches = record_launches(monkeypatch)
    kernels = {kernel_name(entry) for entry in launches}
    # Every kernel tandem defines for CUDA is reached by one of the runs.
    assert kernels >= {
        "grouped_gemm_kernel", "masked_gemm_kernel", "_decode_split", "_merge_splits", "align_kernel",
        "silu_and_mul_kernel", "topk_kernel", "add_rms_norm_kernel", "rope_cache_kernel", "sum_pairs_kernel",
    }, kernels  # fmt: skip
    # The pair sum with the shared experts' output (DeepSeek's layers) and without it.
    assert {e["kwargs"]["ADD_SHARED"] for e in launches if kernel_name(e) == "sum_pairs_kernel"} == {True, False}
    manifest = {"about": __doc__.split("\n\n")[0], "launches": launches}
    committed = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else None
    if committed != manifest:
        MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
        old = {label(e) for e in (committed or {}).get("launches", [])}
        new = {label(e) for e in launches}
        pytest.fail(
            f"{MANIFEST.name} was out of date and is rewritten: commit it. "
            f"New: {sorted(new - old)}; gone: {sorted(old - new)}"
        )
