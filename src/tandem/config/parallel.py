"""`ParallelConfig`: data, expert and pipeline parallelism, the MoE backends, SBO and the
modelled interconnect. The backends' own rules (which options each takes, its dispatch
budget) live with them in `tandem.modular_kernels`; this section asks them."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.options import option, parse_int_tuple


@dataclass
class ParallelConfig:
    """Data parallelism across ranks and expert parallelism of the MoE layers over them."""

    data_parallel_size: int = option(
        1, "DP ranks (processes); experts are sharded across them (under torchrun: WORLD_SIZE / pipeline stages)."
    )
    #: None: "local" on one rank, "torch_a2a" on several.
    all2all_backend: str | None = option(
        None, "local | torch_a2a | torch_a2a_ll | deepep_low_latency | deepep_high_throughput"
    )
    moe_backend: str = option("torch", "torch | triton | deep_gemm")
    enable_sbo: bool = option(False, "Single-batch overlap inside each MoE layer (see --sbo-mode).")
    sbo_mode: str = option(
        "auto",
        "auto | combine-down-gemm (the combine leaves block by block while the down projection runs) | "
        "combine-shared (shared experts while the combine is in flight) | dispatch-shared (shared experts while the "
        "dispatch is in flight); auto picks per backend as SGLang does.",
    )
    use_fp8_dispatch: bool = False
    fabric_latency_us: float | None = option(None, "Modelled interconnect: per-transfer latency.")
    fabric_gbps: float | None = option(None, "Modelled interconnect: bandwidth in GB/s.")
    fabric: str | None = option(
        None,
        "Modelled interconnect preset, e.g. deepep-ll-h800 (DeepEP low-latency, H800, EP8) or deepep-ll-h800-ep64.",
    )
    #: The dispatch's token budget: tokens one rank may send per dispatch. Only the fixed-size
    #: (low-latency) backends have one; None derives it (see `EngineConfig.dispatch_budget`).
    dispatch_max_tokens_per_rank: int | None = option(
        None,
        "Tokens one rank may dispatch at once, for the fixed-buffer backends only (torch_a2a_ll: default "
        "--max-num-batched-tokens; deepep_low_latency: default 128, DeepEP needs (T+1)*2 <= NVSHMEM_QP_DEPTH and "
        "ranks*T divisible by 4). Other backends refuse it.",
    )
    #: Deprecated spelling of `dispatch_max_tokens_per_rank` (DeepEP low-latency only).
    deepep_ll_max_tokens_per_rank: int | None = option(
        None, "Deprecated: use --dispatch-max-tokens-per-rank.", hidden=True
    )
    #: Pipeline parallelism: stage processes (world = PP x DP), the layers per stage (None:
    #: even), micro-batches in flight beyond one per stage, and an explicit ring size
    #: (None: PP + depth; 1 is the one-micro-batch baseline the benchmark compares with).
    pipeline_parallel_size: int = option(1, "Pipeline stages (processes); the decoder layers are split over them.")
    pp_layer_partition: tuple[int, ...] | None = option(
        None, "Decoder layers per pipeline stage, e.g. 10,14 (default: even).", cli_type=str, parse=parse_int_tuple
    )
    pp_async_batch_depth: int = option(0, "Micro-batches in flight beyond one per pipeline stage.")
    pp_num_micro_batches: int | None = None
    enable_dynamic_chunking: bool = option(
        False, "Size prompt chunks from a latency model fitted at start-up, so each chunk costs about the same."
    )

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.data_parallel_size

    @property
    def num_micro_batches(self) -> int:
        if self.pp_num_micro_batches is not None:
            return self.pp_num_micro_batches
        return self.pipeline_parallel_size + self.pp_async_batch_depth

    def __post_init__(self) -> None:
        from tandem.modular_kernels.fabric import FabricModel
        from tandem.modular_kernels.factory import check_dispatch_options
        from tandem.modular_kernels.moe_config import resolve_budget_alias

        if self.pipeline_parallel_size < 1:
            raise ValueError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pp_async_batch_depth < 0:
            raise ValueError(f"--pp-async-batch-depth must be >= 0, got {self.pp_async_batch_depth}")
        if self.pp_num_micro_batches is not None and self.pp_num_micro_batches < 1:
            raise ValueError(f"pp_num_micro_batches must be >= 1, got {self.pp_num_micro_batches}")
        if self.pp_layer_partition is not None:
            self.pp_layer_partition = parse_int_tuple(self.pp_layer_partition)
            if len(self.pp_layer_partition) != self.pipeline_parallel_size:
                raise ValueError(
                    f"--pp-layer-partition has {len(self.pp_layer_partition)} entries for "
                    f"--pipeline-parallel-size {self.pipeline_parallel_size}"
                )
        from tandem.modular_kernels.sbo import SBO_MODES

        FabricModel.from_flags(self.fabric_latency_us, self.fabric_gbps, self.fabric)  # validates
        if self.sbo_mode not in SBO_MODES:
            raise ValueError(f"--sbo-mode must be one of {', '.join(SBO_MODES)}, got {self.sbo_mode!r}")
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        self.dispatch_max_tokens_per_rank = resolve_budget_alias(
            self.dispatch_max_tokens_per_rank, self.deepep_ll_max_tokens_per_rank
        )
        self.deepep_ll_max_tokens_per_rank = None
        if self.all2all_backend is None:
            self.all2all_backend = "local" if self.data_parallel_size == 1 else "torch_a2a"
        if self.all2all_backend == "local" and self.data_parallel_size > 1:
            raise ValueError("--all2all-backend local runs one rank; pick torch_a2a or torch_a2a_ll for --data-parallel-size > 1")
        has_fabric = any(v is not None for v in (self.fabric_latency_us, self.fabric_gbps, self.fabric))
        check_dispatch_options(
            self.all2all_backend,
            dispatch_max_tokens_per_rank=self.dispatch_max_tokens_per_rank,
            fabric=True if has_fabric else None,
        )
        if self.all2all_backend == "deepep_low_latency":
            from tandem.modular_kernels.prepare_deepep import check_low_latency_budget

            check_low_latency_budget(self.dispatch_budget(None), self.data_parallel_size)

    def dispatch_budget(self, max_num_batched_tokens: int | None) -> int | None:
        """The dispatch token budget the chosen backend runs with: the flag, else the
        backend's default (torch_a2a_ll: a whole step's tokens; deepep_low_latency: 128, the
        buffer vLLM sizes for), else None (a backend with no fixed buffer)."""
        if self.dispatch_max_tokens_per_rank is not None:
            return self.dispatch_max_tokens_per_rank
        from tandem.modular_kernels.factory import default_dispatch_budget

        return default_dispatch_budget(self.all2all_backend, max_num_batched_tokens)
