"""`MoEStack`: the synthetic stack of MoE layers behind `--model moe-stack` (attention stand-in,
routed top-k experts, one shared expert), one rank of it, stepped in every bench mode and in
the floor's compute-only and communication-only halves."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tandem.bench.modes import MODES, PHASES, mode_flags
from tandem.config import OverlapConfig
from tandem.contexts import OperationsStrategy, StageExecutor, StepTimes, make_executor, measure_step, run_ubatches
from tandem.models.layer_operations import DecoderLayerOperations
from tandem.modular_kernels import (
    ActivationFormat,
    Experts,
    FabricModel,
    FusedMoEModularKernel,
    build_moe_kernel,
    expert_mlp,
    select_experts,
)
from tandem.modular_kernels.factory import DISPATCH_OPTIONS
from tandem.ubatch.planner import StepShape
from tandem.worker.planner_cache import PlannerCache, observe_step
from tandem.worker.step_plan import decide_overlap

#: The `--model` name that benches this stack (`MoEStackWorkload`).
MOE_STACK = "moe-stack"


class _NoExperts(Experts):
    """Zero-cost experts for the communication-only step."""

    def __init__(self, activation_format: ActivationFormat):
        self.activation_format = activation_format
        self.name = "none"

    def apply(self, tokens, w1, w2):
        return torch.zeros(tokens.hidden.shape, dtype=tokens.dtype)


class _StackLayer(DecoderLayerOperations):
    """One layer of the stack as TBO operations (the same math as `MoEStack._forward`):
    no norms, the attention stand-in cut into prepare (`tanh(x wa)`) and core (`@ wb`), the
    router, the kernel's steps."""

    def __init__(self, weights: dict, kernel: FusedMoEModularKernel, top_k: int):
        self.weights, self.kernel, self.top_k = weights, kernel, top_k
        self.self_attn = self.feed_forward = self
        self.expert_weights = (weights["w1"], weights["w2"])

    @staticmethod
    def input_layernorm(x: torch.Tensor, residual: torch.Tensor | None = None):
        """No norm; given the previous layer's residual, its add (as `post_attention_layernorm`)."""
        return x if residual is None else _StackLayer.post_attention_layernorm(x, residual)

    @staticmethod
    def post_attention_layernorm(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add with no norm, in the decoder's fused add + norm shape: (normed, sum)."""
        hidden = x + residual
        return hidden, hidden

    def prepare(self, positions, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weights["wa"])

    def attention_core(self, prepared: torch.Tensor) -> torch.Tensor:
        return prepared @ self.weights["wb"]

    def router_logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weights["router"]

    def select(self, logits: torch.Tensor):
        return select_experts(logits, self.top_k, renormalize=True)


#: The stack's shape (the MoE-layer benchmark's): hidden 1024, intermediate 512, top-2 of
#: 8 routed experts, one shared expert, 4 layers.
STACK_SHAPE = dict(hidden=1024, intermediate=512, experts=8, top_k=2, layers=4)


class MoEStack:
    """A stack of MoE layers on one rank of `world`: attention stand-in (two dense layers),
    router, routed experts through `FusedMoEModularKernel`, shared expert."""

    #: Extra modes beyond `MODES`: the floor's two halves, the compute-only step run on the
    #: DBO halves one after the other (the price of smaller GEMMs), DBO with the shared
    #: experts at the dispatch instead of the combine (SBO dispatch-shared).
    EXTRA_MODES = ("compute", "compute-split", "comm", "dbo-shared@dispatch")

    def __init__(
        self,
        rank: int,
        world: int,
        *,
        backend: str = "torch_a2a",
        num_ubatches: int = 2,
        executor: str = "thread",
        phase: str = "decode",
        **shape,
    ):
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        #: Only `tbo` reads it: SGLang's decode strategy (delta 2) or prefill strategy (delta 0).
        self.phase = phase
        cfg = {**STACK_SHAPE, **shape}
        self.cfg, self.rank, self.world = cfg, rank, world
        self.backend, self.num_ubatches, self.executor = backend, num_ubatches, executor
        g = torch.Generator().manual_seed(0)
        H, I, E = cfg["hidden"], cfg["intermediate"], cfg["experts"]
        local = E // world
        self.layers = []
        for _ in range(cfg["layers"]):
            self.layers.append(
                dict(
                    wa=torch.randn(H, H, generator=g) * H**-0.5,
                    wb=torch.randn(H, H, generator=g) * H**-0.5,
                    router=torch.randn(H, E, generator=g) * H**-0.5,
                    w1=(torch.randn(E, 2 * I, H, generator=g) * H**-0.5)[rank * local : (rank + 1) * local].contiguous(),
                    w2=(torch.randn(E, H, I, generator=g) * I**-0.5)[rank * local : (rank + 1) * local].contiguous(),
                    sw1=torch.randn(2 * I, H, generator=g) * H**-0.5,
                    sw2=torch.randn(H, I, generator=g) * I**-0.5,
                )
            )
        self.executors = {kind: make_executor(kind) for kind in ("thread", "greenlet")}
        self.executors["stages"] = StageExecutor()
        self._inputs: dict[int, torch.Tensor] = {}
        #: The overlap timeline's recorder (`tandem.contexts.trace.Tracer`), or None.
        self.tracer = None
        #: The runtime's planner bookkeeping: one planner per overlap setting, kept across modes.
        self.planners = PlannerCache()

    def inputs(self, tokens: int) -> torch.Tensor:
        if tokens not in self._inputs:
            gen = torch.Generator().manual_seed(self.rank + 1)
            self._inputs[tokens] = torch.randn(tokens, self.cfg["hidden"], generator=gen)
        return self._inputs[tokens]

    def _kernel(self, layer: dict, *, comm: bool, sbo: str | None, fabric, max_tokens: int):
        shared = lambda h: expert_mlp(h, layer["sw1"], layer["sw2"])  # noqa: E731
        E, K, H = self.cfg["experts"], self.cfg["top_k"], self.cfg["hidden"]
        if not comm:
            return build_moe_kernel("local", "torch", num_experts=E // self.world, top_k=K, hidden_size=H, shared_experts=shared)
        return build_moe_kernel(
            self.backend, "torch", num_experts=E, top_k=K, hidden_size=H, shared_experts=shared,
            enable_sbo=sbo is not None, sbo_mode=sbo or "auto", fabric=fabric,
            dispatch_max_tokens_per_rank=max_tokens if "dispatch_max_tokens_per_rank" in DISPATCH_OPTIONS[self.backend] else None,
        )

    def _forward(self, x, kernels, *, compute: bool, local_ids: bool):
        E_local = self.cfg["experts"] // self.world
        for layer, kernel in zip(self.layers, kernels):
            h = x + torch.tanh(x @ layer["wa"]) @ layer["wb"] if compute else x
            weights, ids = select_experts(h @ layer["router"], self.cfg["top_k"], renormalize=True)
            if local_ids:
                ids = ids % E_local
            x = h + kernel(h, layer["w1"], layer["w2"], weights, ids)
        return x

    def _forward_tbo(self, x, kernels):
        """The stack on the stage executor with SGLang's strategy for the phase."""
        layers = [_StackLayer(layer, kernel, self.cfg["top_k"]) for layer, kernel in zip(self.layers, kernels)]
        decode = self.phase == "decode"
        strategy = OperationsStrategy.concat([layer.operations_strategy(decode=decode) for layer in layers])
        chunks = x.tensor_split(self.num_ubatches)
        outputs = self.executors["stages"].run(
            [{"hidden_states": chunk, "positions": None} for chunk in chunks],
            [strategy.operations] * len(chunks),
            [i * strategy.delta_stages for i in range(len(chunks))],
        )
        # The last layer hands its output and residual on unsummed: the stack's last add.
        return [out["residual"] + out["hidden_states"] for out in outputs]

    def step_overlap(self, overlap: OverlapConfig, tokens: int, fabric: FabricModel | None) -> StepTimes:
        """One step decided as the runtime decides it (`decide_overlap`: the DP all-reduce
        of `coordinate_ubatching`, with the planner's predictions under `auto`), then no
        split or DBO with the agreed ubatch count. The stack has no KV attention and is
        costed as a decode step (the decode threshold applies)."""
        planner = self.planners.planner(overlap, sbo=False) if overlap.overlap_policy == "auto" else None
        shape = StepShape(tokens)
        planned, k, agree_s = self._agree(overlap, planner, shape)
        times = self.step("none" if k == 1 else "dbo", tokens, fabric, num_ubatches=k)
        # The agreement is part of the step (a synchronous collective: exposed communication).
        times = times.with_blocking(agree_s)
        if planner is not None:
            observe_step(planner, planned, shape, times)
        return times

    def step_static(self, mode: str, overlap: OverlapConfig, tokens: int, fabric: FabricModel | None) -> StepTimes:
        """One step of a fixed `mode` as the runtime runs it: the ranks agree on the step first
        (the all-reduce of `coordinate_ubatching`, which the runtime's static policy does every
        step too), so a fixed mode pays what `auto` pays, and only the planner's choice differs."""
        _, _, agree_s = self._agree(overlap, None, StepShape(tokens))
        return self.step(mode, tokens, fabric).with_blocking(agree_s)

    def _agree(self, overlap: OverlapConfig, planner, shape: StepShape):
        """(the planner's choice, the agreed ubatch count, the seconds the agreement took)."""
        start = time.perf_counter()
        group = dist.group.WORLD if self.world > 1 else None
        _, planned, k = decide_overlap(overlap, planner, shape, group=group)
        return planned, k, time.perf_counter() - start

    def step(self, mode: str, tokens: int, fabric: FabricModel | None, *, num_ubatches: int | None = None) -> StepTimes:
        """One step of `mode` on this rank (no barrier, no gathering): its time model."""
        if mode not in MODES + self.EXTRA_MODES:
            raise ValueError(f"unknown mode {mode!r}")
        if mode == "auto":
            raise ValueError("the auto mode runs through step_overlap (it needs the overlap settings)")
        num_ubatches = num_ubatches or self.num_ubatches
        x = self.inputs(tokens)
        comm = not mode.startswith("compute")
        dbo = mode.startswith("dbo") or mode == "tbo"
        if mode == "dbo-shared@dispatch":
            sbo = "dispatch-shared"
        else:
            sbo = mode_flags(mode)[2] if mode in MODES else None
        # A ubatch's static low-latency buffers only need room for its own tokens.
        max_tokens = -(-tokens // num_ubatches) if dbo else tokens
        kernels = [self._kernel(layer, comm=comm, sbo=sbo, fabric=fabric, max_tokens=max_tokens) for layer in self.layers]
        if mode == "comm":
            for k in kernels:
                k.experts = _NoExperts(k.experts.activation_format)
                k.shared_experts = None
        run = lambda chunk: self._forward(chunk, kernels, compute=mode != "comm", local_ids=not comm)  # noqa: E731
        executor = self.executors["stages" if mode == "tbo" else "greenlet" if mode == "dbo-greenlet" else self.executor]
        with measure_step(executor, self.tracer, mode=mode, tokens=tokens) as measured:
            if mode == "tbo":
                self._forward_tbo(x, kernels)
            elif dbo:
                run_ubatches([lambda c=c: run(c) for c in x.tensor_split(num_ubatches)], executor=executor)
            elif mode == "compute-split":
                for chunk in x.tensor_split(num_ubatches):
                    run(chunk)
            else:
                run(x)
        return measured.times


__all__ = ["MOE_STACK", "STACK_SHAPE", "MoEStack"]
