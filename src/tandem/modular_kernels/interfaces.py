"""The two halves of a modular fused-MoE kernel and the data that flows between them.

A `PrepareAndFinalize` moves tokens to the ranks that hold their experts and back; an
`Experts` runs the grouped GEMMs on what arrived. They meet in one of two activation
formats and only pair when the formats agree.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Optional

import torch

from tandem.modular_kernels.quant import dequantize_fp8

#: A receive hook: issues the receiving half of a transfer (on GPU, a kernel launch on the
#: comm stream). Under DBO the next ubatch runs it after queueing its own compute.
RecvHook = Callable[[], None]


class ActivationFormat(enum.Enum):
    #: `[num_tokens, H]`, each row with its local top-k ids (-1: not on this rank) and weights.
    STANDARD = "standard"
    #: `[E_local, max_tokens, H]`: rows of expert e packed first, `expert_num_tokens[e]` valid.
    MASKED = "masked"


@dataclass
class ExpertTokens:
    """What dispatch delivers to the experts of this rank."""

    hidden: torch.Tensor
    #: fp8 per-token-group scales (`hidden` is then float8_e4m3fn), else None.
    scales: torch.Tensor | None
    #: compute dtype of the model (the dtype outputs must have).
    dtype: torch.dtype
    #: STANDARD: local expert ids `[N, K]`, -1 where the expert lives on another rank.
    topk_ids: torch.Tensor | None = None
    #: STANDARD: `[N, K]`.
    topk_weights: torch.Tensor | None = None
    #: MASKED: `[E_local]` rows received per local expert.
    expert_num_tokens: torch.Tensor | None = None
    #: backend state that finalize needs (layout, counts, handles).
    handle: Any = None

    def block(self, block: "torch.Tensor | slice") -> "ExpertTokens":
        """The tokens of one block of a blocked combine: STANDARD, the rows at the
        indices `block`; MASKED, the local experts in the slice `block`."""
        scales = None if self.scales is None else self.scales[block]
        if isinstance(block, slice):
            return ExpertTokens(
                self.hidden[block], scales, self.dtype, expert_num_tokens=self.expert_num_tokens[block], handle=self.handle
            )
        return ExpertTokens(
            self.hidden[block], scales, self.dtype, topk_ids=self.topk_ids[block],
            topk_weights=self.topk_weights[block], handle=self.handle,
        )

    def dequantized(self) -> torch.Tensor:
        if self.scales is None:
            return self.hidden.to(self.dtype)
        return dequantize_fp8(self.hidden, self.scales, self.dtype)


#: The send half of a dispatch (`PrepareAndFinalize.prepare_before_send`): issues the transfer
#: and returns `(hook, receiver)` as `prepare_async` does.
DispatchSend = Callable[[], tuple[Optional[RecvHook], Callable[[], ExpertTokens]]]
#: The send half of a combine (`PrepareAndFinalize.finalize_before_send`): issues it and
#: returns `(hook, receiver)` as `finalize_async` does.
CombineSend = Callable[[], tuple[Optional[RecvHook], Callable[[], torch.Tensor]]]


class BlockCombine(ABC):
    """A combine sent block by block while the down projection still runs (SBO
    `combine-down-gemm`). `blocks[i]` says what block i covers in the experts' layout:
    STANDARD, a LongTensor of received-row indices; MASKED, a slice of local experts.
    Every rank sends the same number of blocks in the same order (each block is one
    transfer of the whole group)."""

    blocks: list

    @abstractmethod
    def send(self, index: int, output: torch.Tensor) -> None:
        """Issue block `index`'s share of the combine; `output` is the experts' output for
        that block (`Experts.apply_blocks`), final once this is called."""

    @abstractmethod
    def finish(self) -> tuple[RecvHook | None, Callable[[], torch.Tensor]]:
        """After the last block: `(hook, receiver)` as `finalize_async` returns them."""


def require_process_group(backend: str, group) -> None:
    """A ValueError unless `backend` has a group to run over (given, or the default one)."""
    if group is None and not torch.distributed.is_initialized():
        raise ValueError(f"all2all backend {backend!r} needs an initialised torch.distributed process group")


class PrepareAndFinalize(ABC):
    """Dispatch (prepare) and combine (finalize) for one rank of an expert-parallel group.

    Rank r of R holds global experts `[r * E_local, (r + 1) * E_local)`.
    """

    activation_format: ActivationFormat
    name: str
    #: True when, under DBO, the backend's own send yields to the other ubatch (its transfer
    #: blocks the CPU, so the other ubatch queues its compute first): the kernel then adds
    #: no yield of its own between send and receive, and TBO's operation lists put the stage's
    #: yield between `prepare_before_send` and the send it returns.
    yields_in_send: bool = False
    #: False when a transfer waits on the CPU for device data, which a captured graph
    #: never delivers: such a backend cannot run under `graph_mode="full"`.
    graph_capturable: bool = True
    #: True when fp8 dispatch can deliver packed UE8M0 scales (`prepare_async(ue8m0=True)`),
    #: the layout DeepGEMM's SM100 GEMMs read: no other backend is ever asked for them.
    dispatches_ue8m0: bool = False
    #: True when the first transfer initialises the library or compiles kernels (minutes on a
    #: cold cache): the runner warms it up with one unsplit step before serving, outside DBO.
    compiles_on_first_use: bool = False
    #: True when the combine hands the experts' output back as it is (one rank, no transfer,
    #: no reduction): the experts may then add the shared experts' output themselves.
    combine_is_identity: bool = False
    #: The dispatch options of `MoEConfig` this backend reads (`dispatch_max_tokens_per_rank`,
    #: `fabric`, `comm_sms`): a config that sets any other one for it is refused, so no
    #: setting is silently dropped. (fp8 dispatch and SBO work with every backend.)
    dispatch_options: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def from_moe_config(cls, config, *, num_experts: int, hidden_size: int) -> PrepareAndFinalize:
        """This backend for a layer of `num_experts` (global) experts over `config.group`, from
        `config` (a `MoEConfig`), reading only the options it declares."""
        raise NotImplementedError(f"{cls.__name__} is not built from a MoEConfig")

    @classmethod
    def default_dispatch_budget(cls, max_num_batched_tokens: int | None) -> int | None:
        """The dispatch token budget when none is given; None for a backend with no fixed buffer."""
        return None

    def __init__(self, num_experts: int, rank: int = 0, world_size: int = 1):
        if num_experts % world_size:
            raise ValueError(f"{num_experts} experts do not divide evenly over {world_size} ranks")
        self.num_experts = num_experts
        self.rank = rank
        self.world_size = world_size
        self.num_local_experts = num_experts // world_size

    @property
    def moves_tokens(self) -> bool:
        """True when dispatch and combine move tokens between ranks (or model a transfer that
        would): only then is there communication for DBO or SBO to hide."""
        return self.world_size > 1

    def supports_async(self) -> bool:
        """True when `prepare_async`/`finalize_async` return before the transfer completes,
        so a DBO yield between send and receive hides it."""
        return False

    def supports_block_combine(self) -> bool:
        """True when `finalize_in_blocks` can send the combine one block at a time."""
        return False

    def finalize_in_blocks(
        self,
        tokens: ExpertTokens,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        num_sms: int | None = None,
    ) -> BlockCombine:
        """Start a combine that `Experts.apply_blocks` feeds block by block; `num_sms` caps
        the SMs its GPU kernels take (where the library allows it)."""
        raise NotImplementedError(f"the {self.name!r} all2all backend cannot combine block by block")

    def prepare_before_send(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        use_fp8: bool,
        ue8m0: bool = False,
    ) -> DispatchSend:
        """The dispatch in two halves: run now what comes before the transfer (never blocking
        the host) and return the send, which issues it. A backend whose send blocks the host
        (`yields_in_send`) does its casts and records its compute here, so TBO can run the send
        after the stage's yield, once the other ubatch has queued its work. This default does
        nothing before: the send is the whole `prepare_async`."""
        return lambda: self.prepare_async(hidden, topk_weights, topk_ids, use_fp8=use_fp8, ue8m0=ue8m0)

    @abstractmethod
    def prepare_async(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        use_fp8: bool,
        ue8m0: bool = False,
    ) -> tuple[RecvHook | None, Callable[[], ExpertTokens]]:
        """Issue the dispatch of `hidden [T, H]` to the experts named by global `topk_ids`;
        with `use_fp8` in fp8 with per-128-channel scales: float32, or with `ue8m0` (only
        asked of a backend with `dispatches_ue8m0`) powers of two packed four to an int32.

        Returns `(hook, receiver)`: `hook()` issues the receive (None when the backend has
        nothing to issue); `receiver()`, called after the hook by the ubatch that sent,
        waits for the data and returns the tokens. On CPU a transfer is already in flight
        once sent, so the torch backends have no hook and wait in the receiver, where the
        data is needed: the next ubatch is never blocked on someone else's transfer.
        """

    def finalize_before_send(
        self,
        expert_output: torch.Tensor,
        tokens: ExpertTokens,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> CombineSend:
        """The combine in two halves, as the dispatch: what must happen right after the
        experts now (a backend whose combine waits on recorded compute records it here: TBO
        issues that combine a stage later, once the other ubatch's experts are queued too,
        and it must not wait for them), the send later. This default does nothing before."""
        return lambda: self.finalize_async(expert_output, tokens, topk_weights, topk_ids)

    @abstractmethod
    def finalize_async(
        self,
        expert_output: torch.Tensor,
        tokens: ExpertTokens,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> tuple[RecvHook | None, Callable[[], torch.Tensor]]:
        """Issue the combine; the receiver returns `[T, H]`, the weighted sum over top-k."""


class Experts(ABC):
    """Grouped expert GEMMs on one rank's local experts."""

    activation_format: ActivationFormat
    name: str
    #: True when `apply_blocks` runs the up projection once and only the down projection
    #: per block (what SBO `auto` wants before it picks combine-down-gemm).
    blocks_down_projection: bool = False
    #: False when `apply` reads device values on the host (or has data-dependent shapes),
    #: which a CUDA graph capture refuses: such experts cannot run under `graph_mode="full"`.
    graph_capturable: bool = True
    #: True when the first call compiles kernels (Triton, DeepGEMM's JIT): the runner warms
    #: them up with one unsplit step before serving, outside DBO.
    compiles_on_first_use: bool = False

    @classmethod
    def from_moe_config(cls, config, *, num_experts: int, top_k: int) -> Experts:
        """These experts, from `config` (a `MoEConfig`), for a layer routing `top_k` of
        `num_experts` (global) experts; only backends whose kernels take a load hint read the shape."""
        return cls()

    def prepare_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> tuple:
        """The expert weights in the form `apply` reads, made once when the model's weights
        are loaded; the model then keeps these instead of `w1`/`w2` (which it frees). The
        default keeps the weights as they are."""
        return w1, w2

    def adds_shared_output(self, device: torch.device) -> bool:
        """True when, on `device`, `apply` takes `shared=` (`[N, H]`, STANDARD) and adds it
        to its output in its last reduction, bit for bit what adding it after gives (the
        Triton pair sum): the modular kernel then hands it the shared experts' output
        where that is ready before the experts run and the combine is the identity."""
        return False

    def takes_ue8m0_scales(self, device: torch.device) -> bool:
        """True when, on `device`, `apply` reads fp8 activations with packed UE8M0 scales as
        they are (DeepGEMM on SM100): fp8 dispatch then asks a backend that can make them
        for those instead of float32 scales the experts would requantize."""
        return False

    @abstractmethod
    def apply(self, tokens: ExpertTokens, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """`w1 [E_local, 2I, H]` (gate rows then up rows), `w2 [E_local, H, I]`.

        STANDARD: returns `[N, H]`, each row the top-k-weighted sum of its local experts.
        MASKED: returns `[E_local, M, H]` unweighted per-expert outputs; rows past
        `expert_num_tokens[e]` are zero.
        """

    def apply_blocks(
        self, tokens: ExpertTokens, w1: torch.Tensor, w2: torch.Tensor, blocks: list
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """`(i, output of block i)` as each block of `blocks` (see `BlockCombine`) is
        final, so its combine can leave while the next one computes. This default runs
        `apply` on each block's tokens; a backend that can share the up projection
        across blocks and block only the down projection overrides it."""
        for index, block in enumerate(blocks):
            if isinstance(block, slice):
                yield index, self.apply(tokens.block(block), w1[block], w2[block])
            else:
                yield index, self.apply(tokens.block(block), w1, w2)
