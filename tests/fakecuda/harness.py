"""Fake CUDA: tandem's CUDA code paths on `FakeTensorMode` CUDA tensors, on a machine with
no GPU and no driver (the CUDA build of torch is needed: the CPU build cannot dispatch
CUDA kernels' fake implementations).

What is real: every torch op tandem issues, with CUDA dtype/shape/device propagation, and
FakeTensorMode's refusal of data-dependent host reads (`.item()`, `.tolist()`, `bool(t)`:
DataDependentOutputException) and of data-dependent shapes (`nonzero`, `bincount`, mask
indexing: DynamicOutputShapeException). What is stubbed, at the library boundary: Triton
kernel launches, DeepGEMM's GEMMs and DeepEP's low-latency Buffer (each checks that what
it is given lives on CUDA with the dtype the real library takes, and launches nothing),
streams and events (the CPU platform's ordering tokens: `torch.cuda.Stream()` needs a
driver), and graph capture (a graph whose capture runs the callable once with
`graph_capture_active()` true and whose replay returns the captured outputs).
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from tandem.platform import CpuPlatform, triton_launches
from tandem.platform.graph import Graph, _capturing, _CaptureState

CUDA = torch.device("cuda", 0)

#: Every fake-CUDA test module's `pytestmark`: the `fakecuda` job's marker, and a skip on the
#: CPU build of torch.
FAKECUDA_MARKS = [
    pytest.mark.fakecuda,
    pytest.mark.skipif(
        torch.version.cuda is None,
        reason="needs the CUDA build of torch (FakeTensorMode cannot run CUDA ops on the CPU build): "
        "run in the fakecuda venv, see .ci/run",
    ),
]


def _check_cuda(where: str, *tensors) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "cuda":
            raise RuntimeError(f"{where}: got a {t.device} tensor where the GPU library needs CUDA memory")


class FakeCaptureGraph(Graph):
    """Capture semantics without a driver: `fn` runs once as if captured."""

    capture_computes_outputs = True

    def __init__(self) -> None:
        self._outputs = None

    def capture(self, fn, *args, **kwargs):
        with _capturing(_CaptureState()):
            self._outputs = fn(*args, **kwargs)
        return self._outputs

    def replay(self):
        return self._outputs

    @property
    def captured(self) -> bool:
        return self._outputs is not None

    @property
    def outputs(self):
        return self._outputs

    def reset(self) -> None:
        self._outputs = None


class FakeCudaPlatform(CpuPlatform):
    """The CPU platform's streams and events for CUDA tensors, with the fake capture."""

    def new_graph(self):
        return FakeCaptureGraph()


def use_fake_cuda_platform(monkeypatch) -> None:
    """`platform_for("cuda")` answers `FakeCudaPlatform` for the test's duration."""
    import tandem.platform as platform_module

    platform = FakeCudaPlatform()
    real = platform_module._platform_for
    monkeypatch.setattr(platform_module, "_platform_for", lambda t: platform if t == "cuda" else real(t))


class _Launch:
    """A kernel's launches checked and logged: its name in `launches`, and, where the real
    kernel is known, the launch as a manifest entry (`triton_aot.describe`) in `described`;
    each launch is also reported to `tandem.platform.triton_launches`' listeners, as a real
    launch through `JITFunction.run` is (what `tandem profile`'s counter counts)."""

    def __init__(self, name: str, launches: list, kernel=None, described: list | None = None):
        self.name, self.launches, self.kernel, self.described = name, launches, kernel, described

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _check_cuda(f"triton kernel {self.name}", *args)
            self.launches.append(self.name)
            # As the real launcher tells an open OpCounter, under the kernel function's name.
            triton_launches.launched(self.name if self.kernel is None else triton_launches.kernel_name(self.kernel))
            if self.described is not None:
                from tandem.testing.triton_aot import describe

                self.described.append(describe(self.kernel, args, kwargs))

        return launch


def stub_triton(monkeypatch, described: list | None = None) -> list:
    """Triton kernels that check their tensors and launch nothing; returns the launch log
    (and appends each launch's manifest entry to `described` when given). Covers the
    experts' GEMMs, the split-KV decode attention and every fused kernel defined through
    `triton_utils.kernels`. Defining a kernel compiles nothing."""
    from tandem.modular_kernels import experts_triton
    from tandem.models import triton_decode_attention
    from tandem.platform import triton_utils

    launches: list = []

    def stand_in(real) -> SimpleNamespace:
        return SimpleNamespace(**{
            name: _Launch(name, launches, kernel, described) if hasattr(kernel, "run") else kernel
            for name, kernel in vars(real).items()
        })  # fmt: skip

    experts = stand_in(experts_triton._kernels(False))
    monkeypatch.setattr(experts_triton, "_kernels", lambda interpret: experts)
    attention = stand_in(triton_decode_attention._kernels(False))
    monkeypatch.setattr(triton_decode_attention, "_kernels", lambda interpret: attention)
    monkeypatch.setattr(triton_utils, "kernels", lambda define: stand_in(triton_utils._defined(define, False)))
    return launches


def stub_deep_gemm(monkeypatch) -> list:
    """DeepGEMM 2.6.1's names used by tandem, checking devices and fp8 operands."""
    from tandem.modular_kernels import experts_deep_gemm

    calls: list = []
    fp8 = torch.float8_e4m3fn

    def _operands(where, a, b, d):
        _check_cuda(where, a[0], a[1], b[0], b[1], d)
        if a[0].dtype != fp8 or b[0].dtype != fp8 or d.dtype != torch.bfloat16:
            raise RuntimeError(f"{where}: fp8 x fp8 -> bf16 expected, got {a[0].dtype} x {b[0].dtype} -> {d.dtype}")

    def contiguous(a, b, d, m_indices, *args, **kwargs):
        _operands("m_grouped_fp8_gemm_nt_contiguous", a, b, d)
        _check_cuda("m_grouped_fp8_gemm_nt_contiguous", m_indices)
        calls.append("contiguous")

    def masked(a, b, d, masked_m, expected_m, *args, **kwargs):
        _operands("m_grouped_fp8_gemm_nt_masked", a, b, d)
        _check_cuda("m_grouped_fp8_gemm_nt_masked", masked_m)
        if not isinstance(expected_m, int):
            raise RuntimeError(f"expected_m must be a host int, got {type(expected_m).__name__}")
        calls.append("masked")

    def tma_aligned(x):
        _check_cuda("get_mn_major_tma_aligned_tensor", x)
        return x

    module = types.ModuleType("deep_gemm")
    module.m_grouped_fp8_gemm_nt_contiguous = contiguous
    module.m_grouped_fp8_gemm_nt_masked = masked
    module.get_mk_alignment_for_contiguous_layout = lambda: 128
    module.get_mn_major_tma_aligned_tensor = tma_aligned
    module.set_num_sms = lambda n: None
    module.get_num_sms = lambda: 132
    monkeypatch.setitem(sys.modules, "deep_gemm", module)
    # The SM generation is a device query (no driver here): pretend SM90.
    monkeypatch.setattr(experts_deep_gemm, "_arch_major", lambda device: 9)
    return calls


class _EventOverlap:
    def __init__(self, event=None):
        self.event = event


class _StubLowLatencyBuffer:
    """`deep_ep.Buffer` in low-latency mode: DeepEP v2.1's signatures and return layouts,
    checking CUDA bf16 inputs and `topk_idx_t` ids, launching nothing."""

    num_sms = 20
    calls: list = []

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24, **kw):
        self.group = group
        self.rank, self.group_size = group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode

    @staticmethod
    def get_low_latency_rdma_size_hint(T, hidden, num_ranks, num_experts):
        return 1024

    @classmethod
    def set_num_sms(cls, n):
        cls.num_sms = n

    def _check(self, where, x, topk_idx, T):
        _check_cuda(where, x, topk_idx)
        if x.dtype != torch.bfloat16 or topk_idx.dtype != torch.int64:
            raise RuntimeError(f"{where}: bf16 x and int64 topk_idx expected, got {x.dtype}, {topk_idx.dtype}")

    def low_latency_dispatch(self, x, topk_idx, T, num_experts, use_fp8=True, async_finish=False,
                             return_recv_hook=False, **kwargs):
        self._check("low_latency_dispatch", x, topk_idx, T)
        if x.shape[0] > T:
            raise RuntimeError(f"x.size(0) <= num_max_dispatch_tokens_per_rank ({x.shape[0]} > {T})")
        El, R, H = num_experts // self.group_size, self.group_size, x.shape[1]
        recv = torch.empty((El, R * T, H), dtype=torch.bfloat16, device=x.device)
        if use_fp8:
            recv = (recv.to(torch.float8_e4m3fn), torch.empty((El, R * T, H // 128), device=x.device))
        count = torch.empty((El,), dtype=torch.int32, device=x.device)
        type(self).calls.append("dispatch")
        return recv, count, (T, H, num_experts), _EventOverlap(), lambda: None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, async_finish=False, return_recv_hook=False,
                            **kwargs):
        T, H, num_experts = handle
        self._check("low_latency_combine", x.flatten(0, 1), topk_idx, T)
        _check_cuda("low_latency_combine", topk_weights)
        if x.shape[1] != self.group_size * T or topk_weights.dtype != torch.float32:
            raise RuntimeError("x.size(1) == num_ranks * T and fp32 topk_weights expected")
        type(self).calls.append("combine")
        return torch.empty((topk_idx.shape[0], H), dtype=torch.bfloat16, device=x.device), _EventOverlap(), lambda: None


def stub_deep_ep(monkeypatch) -> list:
    module = types.ModuleType("deep_ep")
    module.Buffer = type("Buffer", (_StubLowLatencyBuffer,), {"calls": []})
    module.topk_idx_t = torch.int64
    monkeypatch.setitem(sys.modules, "deep_ep", module)
    return module.Buffer.calls


# -- the GPU-sized model shapes and their step inputs on fake CUDA ------------------------------

QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1e6,
    max_position_embeddings=40960, tie_word_embeddings=False,
)


def _deepseek_v2_lite():
    from tandem.models.deepseek import DeepseekV2ForCausalLM
    from tandem.models.random_deepseek import DEEPSEEK_V2_LITE

    return DeepseekV2ForCausalLM, dict(DEEPSEEK_V2_LITE, num_hidden_layers=3)  # 1 dense + 2 MoE layers


def _qwen3_30b_a3b():
    from tandem.models.qwen_moe import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM, dict(QWEN3_30B_A3B, num_hidden_layers=2)


#: The DeepSeek-V2-Lite shape (MLA, 64 experts top-6, 2 shared) and the Qwen3-30B-A3B shape
#: (GQA with q/k norms, 128 experts top-8), a few layers each.
LAYER_SHAPES = {"deepseek-v2-lite": _deepseek_v2_lite, "qwen3-moe": _qwen3_30b_a3b}


def layer_shape_model(name: str, dtype: torch.dtype):
    """One of `LAYER_SHAPES` on fake CUDA (call inside `FakeTensorMode`), with Triton experts
    and the `local` dispatch, as on one GPU."""
    from tandem.modular_kernels import MoEConfig

    cls, config = LAYER_SHAPES[name]()
    with torch.device("cuda"):
        model = cls(config, moe=MoEConfig(all2all_backend="local", moe_backend="triton"), dtype=dtype)
    model.prepare_weights_after_loading()
    return model.eval()


def decode_chunks(requests: int, context: int) -> list[tuple[int, int]]:
    """(new tokens, cached tokens) of `requests` decode rows after `context` cached tokens."""
    return [(1, context)] * requests


def step_inputs(model, chunks: list[tuple[int, int]], block: int):
    """The model's KV cache bound and one step's inputs on fake CUDA for `chunks` of (new
    tokens, cached tokens): built on the host (real tensors), then moved to the device."""
    import dataclasses

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from tandem.worker import BlockAllocator, ScheduledChunk, allocate_kv_caches, build_step_inputs

    needs = [(new + cached) // block + 1 for new, cached in chunks]
    allocator = BlockAllocator(sum(needs) + 1, reserve_null_block=True)
    model.bind_kv_cache(allocate_kv_caches(model.kv_cache_specs(), sum(needs) + 1, block, device="cuda"))
    scheduled = [
        ScheduledChunk([5 + i % 100 for i in range(new)], cached, allocator.allocate(need))
        for (new, cached), need in zip(chunks, needs)
    ]
    with unset_fake_temporarily():
        inputs = build_step_inputs(scheduled, block)

    def move(obj):
        changes = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, torch.Tensor):
                changes[f.name] = value.to("cuda", non_blocking=True)
            elif dataclasses.is_dataclass(value):
                changes[f.name] = move(value)
        return dataclasses.replace(obj, **changes)

    return move(inputs)
