"""`EngineConfig`, the root of the tree: the model, the device and the step, its sections
(`overlap`, `parallel`, `cache`, `scheduler`), the checks that span sections, the start-up
settings line (`describe`) and the `MoEConfig` every MoE layer is built with."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config.cache import CacheConfig
from tandem.config.options import option
from tandem.config.overlap import OverlapConfig
from tandem.config.parallel import ParallelConfig
from tandem.config.scheduler import SchedulerConfig

#: `--compile`: `auto` decides per device and dtype (tandem.models.compiled.compile_default).
COMPILE_MODES = ("auto", "on", "off")


@dataclass
class EngineConfig:
    model: str = option("tiny-moe", "A Hugging Face model directory, or a built-in preset: tiny-moe, small-moe, deepseek-v2-lite-random.")
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_num_batched_tokens: int = option(2048, "Token budget of one step (prefill is chunked to fit).")
    #: `--trace FILE`: write the overlap timeline of every step as Chrome trace-event JSON.
    trace_path: str | None = option(
        None,
        "Write the overlap timeline (steps, each ubatch's compute, receive waits, switches, transfers; one process "
        "per rank) as Chrome trace-event JSON: open it in ui.perfetto.dev or chrome://tracing. serve writes it when "
        "stopped. Off by default.",
        flag="--trace",
        metavar="FILE",
    )
    #: `--device auto|cpu|cuda` and `--dtype auto|bfloat16|float16|float32`, resolved per
    #: rank by `resolve_device` / `resolve_dtype` (auto: CUDA + bf16 when available, else CPU + fp32).
    device: str = option("auto", "auto | cpu | cuda (auto: CUDA when available; rank i of a host takes cuda:{i % GPUs}).")
    dtype: str = option("auto", "auto | bfloat16 | float16 | float32 (auto: bfloat16 on CUDA, float32 on CPU).")
    compile: str = option("auto", "auto | on | off: run the model step compiled by torch.compile (inductor), attention and "
                          "MoE layers as opaque ops (auto: on for bfloat16 on the CPU, else off; see docs/compiled-step.md). "
                          "The first start compiles (cached on disk for the next).")
    cpu_threads: str = option("auto", "auto | fixed: on a CPU, time each kind of step with 1 thread and with all the rank's "
                              "and keep the faster, re-checked as load changes (fixed: always OMP_NUM_THREADS).")

    def __post_init__(self) -> None:
        from tandem.platform.device import check_device_flag, check_dtype_flag

        check_device_flag(self.device)
        check_dtype_flag(self.dtype)
        for flag, value, allowed in (("--compile", self.compile, COMPILE_MODES), ("--cpu-threads", self.cpu_threads, ("auto", "fixed"))):
            if value not in allowed:
                raise ValueError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
        if self.compile == "on" and self.overlap.greenlet_ubatches:
            raise ValueError(
                "--compile on cannot run with --ubatch-executor greenlet: a greenlet switch at a ubatch yield inside "
                "the compiled step's MoE op crosses C++ frames (the dispatcher's), which greenlets cannot switch over; "
                "use --ubatch-executor thread (or stages), or --compile off"
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.overlap.graph_mode == "full":
            from tandem.modular_kernels.capturable import check_backend_graph_capturable

            check_backend_graph_capturable(self.parallel.all2all_backend, self.parallel.moe_backend)
        if self.overlap.comm_sms is not None:
            from tandem.modular_kernels.factory import check_dispatch_options

            check_dispatch_options(self.parallel.all2all_backend, comm_sms=self.overlap.comm_sms)
        if self.parallel.all2all_backend == "deepep_low_latency":
            from tandem.modular_kernels.prepare_deepep import check_low_latency_step_budget

            check_low_latency_step_budget(self.max_num_batched_tokens, self.dispatch_max_tokens_per_rank)

    def describe(self) -> str:
        """The settings the start-up line of `serve` and `generate` shows, in one place."""
        o, p, s = self.overlap, self.parallel, self.scheduler
        dbo = (
            f"on (ubatches={o.num_ubatches}, executor={o.executor}, policy={o.overlap_policy}, split={o.ubatch_split}, "
            f"thresholds decode={o.dbo_decode_token_threshold} prefill={o.dbo_prefill_token_threshold})"
            if o.enable_dbo
            else "off"
        )
        pp = f" pp={p.pipeline_parallel_size} (depth {p.pp_async_batch_depth})" if p.pipeline_parallel_size > 1 else ""
        return (
            f"model={self.model} dp={p.data_parallel_size}{pp} all2all={p.all2all_backend} moe={p.moe_backend} "
            f"dbo={dbo} sbo={p.sbo_mode if p.enable_sbo else 'off'} graph={o.graph_mode} compile={self.compile} "
            f"device={self.device} dtype={self.dtype} schedule={ {True: 'overlap', False: 'normal', None: 'auto'}[s.overlap_schedule]} "
            f"max_num_seqs={s.max_num_seqs} max_num_batched_tokens={self.max_num_batched_tokens} "
            f"kv_cache={self.cache.usable_tokens} tokens/rank"
        )

    @property
    def dispatch_max_tokens_per_rank(self) -> int | None:
        """The dispatch token budget every MoE layer's kernel is built with."""
        return self.parallel.dispatch_budget(self.max_num_batched_tokens)

    def moe_config(self, group=None):
        """The `MoEConfig` every MoE layer of this rank's model is built with; `group` is the
        expert-parallel group (None: the default one)."""
        from tandem.modular_kernels import FabricModel, MoEConfig

        par = self.parallel
        return MoEConfig(
            all2all_backend=par.all2all_backend,
            moe_backend=par.moe_backend,
            group=group,
            dispatch_max_tokens_per_rank=self.dispatch_max_tokens_per_rank,
            use_fp8_dispatch=par.use_fp8_dispatch,
            enable_sbo=par.enable_sbo,
            sbo_mode=par.sbo_mode,
            fabric=FabricModel.from_flags(par.fabric_latency_us, par.fabric_gbps, par.fabric),
            comm_sms=self.overlap.comm_sms,
        )

    def resolve_device(self, local_rank: int = 0):
        from tandem.platform.device import resolve_device

        return resolve_device(self.device, local_rank)

    def resolve_dtype(self, device):
        from tandem.platform.device import resolve_dtype

        return resolve_dtype(self.dtype, device)
