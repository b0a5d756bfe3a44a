"""What one rank runs in a benchmark step, and how one step is timed across ranks.

Two workloads, same interface:

- `ModelStepWorkload`: one `ModelRunner.execute` of a real model (`tiny-moe` or a Hugging
  Face directory) on a decode batch (T requests of one token over a `context_len` cache)
  or a prefill batch (requests of up to `prefill_len` new tokens), exactly the path
  `tandem serve` runs. Its floor comes from the runtime's time model of the no-overlap
  step: communication = the exposed receive waits of the rank that waited least (so load
  skew between ranks is not counted as communication), compute = the rest, on the slowest
  rank.
- `MoEStackWorkload` (`--model moe-stack`): a stack of MoE layers (attention stand-in,
  routed top-k experts, one shared expert) whose floor is measured directly: a
  compute-only step (experts local, no all-to-all) and a communication-only step (zero-cost
  experts, no attention). It has no attention over a KV cache, so `--phase` only picks
  the strategy of the `tbo` mode (SGLang's decode, delta 2, or prefill, delta 0).

Every step starts after a barrier; its time is the slowest rank's. The time model
(compute, receive wait, communication, switch) is gathered from every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

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
from tandem.config import OverlapConfig
from tandem.modular_kernels.factory import DISPATCH_OPTIONS
from tandem.worker.step_plan import decide_overlap
from tandem.ubatch.planner import StepShape
from tandem.worker.planner_cache import PlannerCache, observe_step
from tandem.worker.ubatch_wrapper import eager_unless_asked

#: SGLang's SBO modes, each as its own bench mode (`sbo` and `dbo+sbo` run `auto`).
SBO_MODE_NAMES = {f"sbo-{m}": m for m in ("combine-down-gemm", "combine-shared", "dispatch-shared")}
#: Modes every workload runs: no overlap, DBO on threads or greenlets, SBO (auto or one
#: mode), DBO with SBO, TBO (the ubatches interleaved stage by stage by the stage executor,
#: no threads), and the overlap planner choosing per step (`--overlap-policy auto`).
MODES = ("none", "dbo", "dbo-greenlet", "sbo", "dbo+sbo", *SBO_MODE_NAMES, "tbo", "auto")
PHASES = ("decode", "prefill")
MOE_STACK = "moe-stack"


@dataclass
class Sample:
    """One timed step: the slowest rank's wall time and every rank's time model."""

    step_s: float
    per_rank: list[StepTimes]

    @property
    def mean_times(self) -> StepTimes:
        return StepTimes.mean(self.per_rank)

    @property
    def floor_compute_s(self) -> float:
        return max(t.compute_s + t.switch_s for t in self.per_rank)

    @property
    def floor_comm_s(self) -> float:
        return min(t.recv_wait_s for t in self.per_rank)


def _gather(times: StepTimes, distributed: bool) -> Sample:
    mine = torch.tensor(times.as_tuple(), dtype=torch.float64)
    if not distributed:
        return Sample(times.step_s, [times])
    from tandem.distributed.launch import cpu_group

    world = dist.get_world_size()
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=cpu_group())  # CPU tensors: the gloo group, whatever the device
    per_rank = [StepTimes(*t.tolist()) for t in everyone]
    return Sample(max(t.step_s for t in per_rank), per_rank)


def _barrier(distributed: bool) -> None:
    if distributed:
        from tandem.distributed.launch import cpu_group

        dist.barrier(group=cpu_group())


def _mode_flags(mode: str) -> tuple[bool, str, str | None]:
    """(DBO on, executor, SBO mode or None) of a mode."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    if mode == "tbo":
        return True, "stages", None
    dbo = mode.startswith("dbo") or mode == "auto"
    sbo = "auto" if mode in ("sbo", "dbo+sbo") else SBO_MODE_NAMES.get(mode)
    return dbo, "greenlet" if mode == "dbo-greenlet" else "thread", sbo


def mode_overlap(base: OverlapConfig, mode: str) -> OverlapConfig:
    """The overlap settings of a mode: fixed modes split every step (thresholds 0) or none;
    `auto` is the planner, falling back to the base's thresholds (a `--thresholds-file`'s)
    or the defaults until it has predictions."""
    dbo, executor, _ = _mode_flags(mode)
    if mode == "auto":
        thresholds = base if base.thresholds_file else OverlapConfig()
        return replace(
            base, enable_dbo=True, executor=executor, overlap_policy="auto",
            dbo_decode_token_threshold=thresholds.dbo_decode_token_threshold,
            dbo_prefill_token_threshold=thresholds.dbo_prefill_token_threshold,
        )
    return replace(
        base, enable_dbo=dbo, executor=executor, overlap_policy="static",
        dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0,
    )


def _kernels(model) -> list[FusedMoEModularKernel]:
    return [m.kernel for m in model.modules() if isinstance(getattr(m, "kernel", None), FusedMoEModularKernel)]


class ModelStepWorkload:
    """One `ModelRunner` step of the model in `config` on this rank."""

    def __init__(self, config, *, phase: str, context_len: int, prefill_len: int, max_tokens: int, distributed: bool):
        from tandem.engine.offline import build_runner
        from tandem.worker.sampling import SamplingParams

        if phase not in PHASES:
            raise ValueError(f"--phase must be one of {PHASES}, got {phase!r}")
        self.phase, self.context_len, self.prefill_len = phase, context_len, prefill_len
        self.distributed = distributed
        bs = config.cache.block_size
        if phase == "decode":
            per_request, num_requests = -(-(context_len + 1) // bs), max_tokens
        else:
            per_request, num_requests = -(-prefill_len // bs), -(-max_tokens // prefill_len)
        blocks = per_request * num_requests + 1  # + the runner's null block
        config = replace(
            config,
            cache=replace(config.cache, num_kv_blocks=max(blocks, config.cache.num_kv_blocks)),
            max_num_batched_tokens=max(config.max_num_batched_tokens, max_tokens),
            overlap=eager_unless_asked(config.overlap),  # the modes compared, step by step
        )
        self.runner = build_runner(config, group=dist.group.WORLD if distributed else None)
        self.base_overlap = config.overlap
        self.kernels = _kernels(self.runner.model)
        self.executors = {kind: make_executor(kind) for kind in ("thread", "greenlet")}
        self.executors["stages"] = StageExecutor()
        self.request_blocks = [self.runner.allocator.allocate(per_request) for _ in range(num_requests)]
        self.params = SamplingParams(max_tokens=1)
        self.vocab = 200  # byte ids: valid for every model's vocabulary

    @property
    def num_moe_layers(self) -> int:
        return len(self.kernels)

    def set_fabric(self, fabric: FabricModel | None) -> None:
        if self.runner.device.type == "cuda" and not self.distributed:
            # One GPU: each transfer becomes a spin kernel on the comm stream (real streams).
            from tandem.modular_kernels.device_fabric import install_device_fabric

            install_device_fabric(self.runner.model, fabric)
            return
        for k in self.kernels:
            if hasattr(k.prepare_finalize, "fabric"):
                k.prepare_finalize.fabric = fabric

    def _chunks(self, tokens: int):
        from tandem.worker.step_inputs import ScheduledChunk

        g = torch.Generator().manual_seed(tokens)
        if self.phase == "decode":
            ids = torch.randint(0, self.vocab, (tokens,), generator=g).tolist()
            return [ScheduledChunk([ids[r]], self.context_len, self.request_blocks[r]) for r in range(tokens)]
        chunks, left, r = [], tokens, 0
        while left > 0:
            n = min(left, self.prefill_len)
            chunks.append(ScheduledChunk(torch.randint(0, self.vocab, (n,), generator=g).tolist(), 0, self.request_blocks[r]))
            left, r = left - n, r + 1
        return chunks

    def set_tracer(self, tracer) -> None:
        self.runner.tracer = tracer

    def measure(self, mode: str, tokens: int) -> Sample:
        _, _, sbo = _mode_flags(mode)
        if self.runner.tracer is not None:
            self.runner.tracer.tags = {"mode": mode}
        # The mode's SBO is the runner's per-step choice; its SBO variant is the kernels' setting.
        self.runner.sbo = sbo is not None
        for k in self.kernels:
            k.sbo_mode = sbo or "auto"
        return self.run_step(mode_overlap(self.base_overlap, mode), self._chunks(tokens))

    def run_step(self, overlap: OverlapConfig, chunks) -> Sample:
        """One step of `chunks` (this rank's `ScheduledChunk`s) under `overlap`."""
        self.runner.overlap = overlap
        self.runner.wrapper.executor = self.executors[overlap.executor]
        _barrier(self.distributed)
        self.runner.execute(chunks, [self.params] * len(chunks), [None] * len(chunks))
        return _gather(self.runner.last_step_times, self.distributed)

    def floor(self, tokens: int, none_sample: Sample | None = None) -> tuple[float, float]:
        """(compute s, communication s) from the no-overlap step's time model."""
        sample = none_sample or self.measure("none", tokens)
        return sample.floor_compute_s, sample.floor_comm_s


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
    def input_layernorm(x: torch.Tensor) -> torch.Tensor:
        return x

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
        return self.executors["stages"].run(
            [{"hidden_states": chunk, "positions": None} for chunk in chunks],
            [strategy.operations] * len(chunks),
            [i * strategy.delta_stages for i in range(len(chunks))],
        )

    def step_overlap(self, overlap: OverlapConfig, tokens: int, fabric: FabricModel | None) -> StepTimes:
        """One step decided as the runtime decides it (`decide_overlap`: the DP all-reduce
        of `coordinate_ubatching`, with the planner's predictions under `auto`), then no
        split or DBO with the agreed ubatch count. The stack has no KV attention and is
        costed as a decode step (the decode threshold applies)."""
        planner = self.planners.planner(overlap, sbo=False) if overlap.overlap_policy == "auto" else None
        shape = StepShape(tokens)
        start = time.perf_counter()
        group = dist.group.WORLD if self.world > 1 else None
        _, planned, k = decide_overlap(overlap, planner, shape, group=group)
        agree_s = time.perf_counter() - start
        times = self.step("none" if k == 1 else "dbo", tokens, fabric, num_ubatches=k)
        # The agreement is part of the step (a synchronous collective: exposed communication).
        times = times.with_blocking(agree_s)
        if planner is not None:
            observe_step(planner, planned, shape, times)
        return times

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
            sbo = _mode_flags(mode)[2] if mode in MODES else None
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


class MoEStackWorkload:
    def __init__(
        self, rank: int, world: int, *, backend: str, num_ubatches: int, executor: str = "thread", phase: str = "decode",
        thresholds_file: str | None = None, **shape,
    ):
        self.stack = MoEStack(rank, world, backend=backend, num_ubatches=num_ubatches, executor=executor, phase=phase, **shape)
        self.base_overlap = OverlapConfig(num_ubatches=num_ubatches).with_thresholds_file(thresholds_file)
        self.distributed = world > 1
        self.fabric: FabricModel | None = None
        self.num_moe_layers = self.stack.cfg["layers"]

    def set_fabric(self, fabric: FabricModel | None) -> None:
        self.fabric = fabric

    def set_tracer(self, tracer) -> None:
        self.stack.tracer = tracer

    def measure(self, mode: str, tokens: int) -> Sample:
        if mode == "auto":
            return self.run_overlap(mode_overlap(self.base_overlap, mode), tokens)
        _barrier(self.distributed)
        return _gather(self.stack.step(mode, tokens, self.fabric), self.distributed)

    def run_overlap(self, overlap: OverlapConfig, tokens: int) -> Sample:
        _barrier(self.distributed)
        return _gather(self.stack.step_overlap(overlap, tokens, self.fabric), self.distributed)

    def floor(self, tokens: int, none_sample: Sample | None = None) -> tuple[float, float]:
        """(compute s, communication s), each its own step."""
        return self.measure("compute", tokens).step_s, self.measure("comm", tokens).step_s


__all__ = ["MODES", "MOE_STACK", "PHASES", "MoEStack", "MoEStackWorkload", "ModelStepWorkload", "Sample", "mode_overlap"]
