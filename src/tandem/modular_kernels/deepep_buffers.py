"""What DeepEP needs before the first dispatch: its import (lazy, with an error that says how
to get it), the limits its kernels put on a layer, and the process's shared Buffers.

Buffers. A `deep_ep.Buffer` holds NVSHMEM symmetric and IPC memory (GiBs at DeepSeek-V3
sizes) and NVSHMEM is initialised once per process, so, as vLLM's all2all manager does,
there is one Buffer per process per (group, mode), built on first use (a collective: every
rank's first dispatch builds it) and shared by every layer and every ubatch. Only the
dispatch handles are per ubatch; they travel in `ExpertTokens.handle`. An adapter may also
be given a Buffer the caller built.

Low-latency budget. The low-latency Buffer is sized for `max_tokens_per_rank` tokens per
rank (`--deepep-ll-max-tokens-per-rank`, default 128, separate from the step's token
budget): DeepEP asserts `(T + 1) * 2 <= NVSHMEM_QP_DEPTH` (default 1024) and
`num_ranks * T % 4 == 0`, and the Buffer grows with T * E * H. `check_low_latency_budget`
checks both before any Buffer exists.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

#: The only activation dtype DeepEP's kernels take (besides fp8 with scales).
DEEPEP_DTYPE = torch.bfloat16
#: Hidden sizes DeepEP's low-latency kernels are instantiated for (`launch.cuh`'s
#: SWITCH_HIDDEN); any other hidden size fails a host assert at the first dispatch.
DEEPEP_LL_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
#: `--deepep-ll-max-tokens-per-rank` default (vLLM sizes its buffer by a 128-256 chunk).
DEFAULT_LL_MAX_TOKENS_PER_RANK = 128
#: NVSHMEM's queue-pair depth when `NVSHMEM_QP_DEPTH` is not set (DeepEP's default).
DEFAULT_NVSHMEM_QP_DEPTH = 1024

_HOW_TO_GET_DEEPEP = (
    "DeepEP is not on PyPI: install tandem's GPU extra (pip install 'tandem[gpu]'), then build and install "
    "DeepEP from its own source (https://github.com/deepseek-ai/DeepEP) against your CUDA toolkit and NVSHMEM, "
    "as the README's GPU extras section says; CPU tests use tandem.testing.fake_deep_ep.install() instead"
)


def import_deep_ep(backend: str):
    """`import deep_ep`, or an ImportError naming the backend and how to get DeepEP."""
    try:
        import deep_ep
    except Exception as exc:  # noqa: BLE001 - DeepEP's import runs asserts (NCCL, CUDA_HOME) too
        raise ImportError(
            f"the {backend!r} all2all backend needs DeepEP (`import deep_ep` failed: {type(exc).__name__}: {exc}). "
            f"{_HOW_TO_GET_DEEPEP}"
        ) from exc
    return deep_ep


def check_low_latency_budget(max_tokens_per_rank: int, num_ranks: int) -> None:
    """Raise a ValueError unless DeepEP's low-latency kernels accept `max_tokens_per_rank`
    tokens per rank on `num_ranks` ranks."""
    T = max_tokens_per_rank
    if not isinstance(T, int) or isinstance(T, bool) or T < 1:
        raise ValueError(f"--deepep-ll-max-tokens-per-rank must be an integer >= 1, got {T!r}")
    qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", DEFAULT_NVSHMEM_QP_DEPTH))
    if (T + 1) * 2 > qp_depth:
        raise ValueError(
            f"--deepep-ll-max-tokens-per-rank={T} is too large for DeepEP's low-latency kernels: they need "
            f"(T + 1) * 2 <= NVSHMEM_QP_DEPTH={qp_depth}, so T <= {qp_depth // 2 - 1} "
            "(or raise NVSHMEM_QP_DEPTH)"
        )
    if (num_ranks * T) % 4:
        fits = next(t for t in range(T, T + 4) if (num_ranks * t) % 4 == 0)
        raise ValueError(
            f"--deepep-ll-max-tokens-per-rank={T} on {num_ranks} ranks: DeepEP's low-latency kernels need "
            f"num_ranks * T = {num_ranks * T} to be a multiple of 4 (TMA moves tokens in fours); use T={fits}"
        )


def check_low_latency_hidden_size(hidden_size: int) -> None:
    """Raise a ValueError unless DeepEP's low-latency kernels exist for `hidden_size`."""
    if hidden_size not in DEEPEP_LL_HIDDEN_SIZES:
        raise ValueError(
            f"--all2all-backend deepep_low_latency cannot run this model: its hidden size {hidden_size} is not one "
            f"DeepEP's low-latency kernels are built for ({', '.join(map(str, DEEPEP_LL_HIDDEN_SIZES))}); use "
            "--all2all-backend torch_a2a_ll (the same semantics on torch.distributed) or deepep_high_throughput"
        )


def check_low_latency_step_budget(max_num_batched_tokens: int, max_tokens_per_rank: int) -> None:
    """Raise a ValueError unless every step fits DeepEP's low-latency budget: a step's MoE
    input is dispatched whole (tandem does not chunk it), and a ubatched step's ubatches are
    smaller than the step, so the step budget must not exceed the per-rank budget."""
    if max_num_batched_tokens > max_tokens_per_rank:
        raise ValueError(
            f"--max-num-batched-tokens {max_num_batched_tokens} exceeds --dispatch-max-tokens-per-rank "
            f"{max_tokens_per_rank}: deepep_low_latency dispatches at most that many tokens per rank and a step's MoE "
            f"input is not chunked; set --max-num-batched-tokens <= {max_tokens_per_rank}, or raise "
            "--dispatch-max-tokens-per-rank (at most NVSHMEM_QP_DEPTH / 2 - 1, 511 by default)"
        )


# ---------------------------------------------------------------------------- shared Buffers

#: (Buffer class, group, low-latency mode) -> (Buffer, SM count an HT Buffer was sized for).
_SHARED_BUFFERS: dict[tuple, tuple[object, int | None]] = {}


def shared_buffer(deep_ep, group, *, low_latency: bool, make: Callable[[], tuple[object, int | None]], needs: dict):
    """The process's Buffer for (group, mode): made by `make()` on the first call (a
    collective), afterwards checked to hold `needs` (attribute -> minimum bytes)."""
    key = (deep_ep.Buffer, group, low_latency)
    entry = _SHARED_BUFFERS.get(key)
    if entry is None:
        entry = _SHARED_BUFFERS[key] = make()
        return entry[0]
    buffer = entry[0]
    short = {name: (getattr(buffer, name), need) for name, need in needs.items() if getattr(buffer, name) < need}
    if short:
        detail = ", ".join(f"{name}={have} < {need}" for name, (have, need) in short.items())
        raise ValueError(
            f"the process's shared {'low-latency' if low_latency else 'high-throughput'} deep_ep.Buffer is too small "
            f"for this layer ({detail}): every DeepEP layer of a process must use the same hidden size, expert "
            "count and token budget (a second Buffer would re-initialise NVSHMEM)"
        )
    return buffer


def ht_buffer_sms_limit() -> int | None:
    """The fewest SMs any shared high-throughput Buffer was sized for (None if there is
    none): DeepEP's HT kernels may not be given more, their NVL buffer would overflow."""
    sized = [sms for (_, _, low_latency), (_, sms) in _SHARED_BUFFERS.items() if not low_latency and sms is not None]
    return min(sized) if sized else None


def release_shared_buffers() -> None:
    """Forget the shared Buffers (each is freed once no adapter holds it any more)."""
    _SHARED_BUFFERS.clear()

