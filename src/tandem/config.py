"""One configuration tree shared by the CLI and the library."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

EXECUTORS = ("thread", "greenlet", "stages")
GRAPH_MODES = ("none", "full")
#: `static`: the two token thresholds decide; `auto`: the overlap planner (tandem.ubatch.planner).
OVERLAP_POLICIES = ("static", "auto")
#: Where a DBO step is cut: at the token midpoint, or where the ubatches' predicted costs match.
UBATCH_SPLITS = ("tokens", "balanced-cost")


@dataclass
class OverlapConfig:
    """When and how a step is split into ubatches (DBO)."""

    enable_dbo: bool = False
    num_ubatches: int = 2
    executor: str = "thread"
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    graph_mode: str = "none"
    #: SMs reserved for communication kernels while ubatches overlap (`--comm-sms`, GPU only).
    comm_sms: int | None = None
    #: TBO prefill split: sequences are cut inside one when no sequence boundary leaves
    #: each part at least this share of the tokens (SGLang's tbo_token_distribution_threshold).
    tbo_token_distribution_threshold: float = 0.48
    overlap_policy: str = "static"
    ubatch_split: str = "tokens"
    #: The `tandem tune` file the thresholds came from; `auto` starts from its sweep.
    thresholds_file: str | None = None
    #: Share of steps the planner runs a choice other than its best (at most 0.05).
    planner_explore_share: float = 0.03

    def __post_init__(self) -> None:
        if self.comm_sms is not None and (self.comm_sms < 2 or self.comm_sms % 2):
            raise ValueError(f"--comm-sms must be an even count >= 2 (DeepEP uses SMs in pairs), got {self.comm_sms}")
        if self.num_ubatches < 2:
            raise ValueError(f"--num-ubatches must be >= 2, got {self.num_ubatches}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"--ubatch-executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"--graph-mode must be one of {GRAPH_MODES}, got {self.graph_mode!r}")
        if not 0.0 <= self.tbo_token_distribution_threshold <= 0.5:
            raise ValueError(
                f"--tbo-token-distribution-threshold must lie in [0, 0.5], got {self.tbo_token_distribution_threshold}"
            )
        if self.overlap_policy not in OVERLAP_POLICIES:
            raise ValueError(f"--overlap-policy must be one of {OVERLAP_POLICIES}, got {self.overlap_policy!r}")
        if self.ubatch_split not in UBATCH_SPLITS:
            raise ValueError(f"--ubatch-split must be one of {UBATCH_SPLITS}, got {self.ubatch_split!r}")
        if not 0.0 <= self.planner_explore_share <= 0.05:
            raise ValueError(f"planner_explore_share must lie in [0, 0.05], got {self.planner_explore_share}")
        for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")

    def with_thresholds_file(self, path: str | Path | None) -> "OverlapConfig":
        """Thresholds from a `tandem tune` file (JSON with `dbo_decode_token_threshold` and
        `dbo_prefill_token_threshold`) override the flags."""
        if path is None:
            return self
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"thresholds file {path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"thresholds file {path} is not valid JSON: {exc}") from None
        keys = ("dbo_decode_token_threshold", "dbo_prefill_token_threshold")
        missing = [k for k in keys if not isinstance(data.get(k), int)]
        if missing:
            raise ValueError(f"thresholds file {path} lacks integer {', '.join(missing)}")
        return OverlapConfig(**{**asdict(self), **{k: data[k] for k in keys}, "thresholds_file": str(path)})


@dataclass
class ParallelConfig:
    """Data parallelism across ranks and expert parallelism of the MoE layers over them."""

    data_parallel_size: int = 1
    all2all_backend: str | None = None  # default: "local" on one rank, "torch_a2a" on several
    moe_backend: str = "torch"
    enable_sbo: bool = False
    sbo_mode: str = "auto"  # one of tandem.modular_kernels.SBO_MODES
    use_fp8_dispatch: bool = False
    fabric_latency_us: float | None = None
    fabric_gbps: float | None = None
    fabric: str | None = None  # a preset name (`--fabric`), instead of latency + bandwidth
    #: tokens per rank deepep_low_latency's buffer holds (`--deepep-ll-max-tokens-per-rank`).
    deepep_ll_max_tokens_per_rank: int = 128
    #: Pipeline parallelism: stage processes (world = PP x DP), the layers per stage (None:
    #: even), micro-batches in flight beyond one per stage, and an explicit ring size
    #: (None: PP + depth; 1 is the one-micro-batch baseline the benchmark compares with).
    pipeline_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    pp_async_batch_depth: int = 0
    pp_num_micro_batches: int | None = None
    #: Size prompt chunks from a latency model fitted at start-up (chunked pipeline prefill).
    enable_dynamic_chunking: bool = False

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

        if self.pipeline_parallel_size < 1:
            raise ValueError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pp_async_batch_depth < 0:
            raise ValueError(f"--pp-async-batch-depth must be >= 0, got {self.pp_async_batch_depth}")
        if self.pp_num_micro_batches is not None and self.pp_num_micro_batches < 1:
            raise ValueError(f"pp_num_micro_batches must be >= 1, got {self.pp_num_micro_batches}")
        if self.pp_layer_partition is not None:
            self.pp_layer_partition = tuple(int(c) for c in self.pp_layer_partition)
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
        if self.all2all_backend is None:
            self.all2all_backend = "local" if self.data_parallel_size == 1 else "torch_a2a"
        if self.all2all_backend == "local" and self.data_parallel_size > 1:
            raise ValueError("--all2all-backend local runs one rank; pick torch_a2a or torch_a2a_ll for --data-parallel-size > 1")
        if self.all2all_backend == "deepep_low_latency":
            from tandem.modular_kernels.prepare_deepep import check_low_latency_budget

            check_low_latency_budget(self.deepep_ll_max_tokens_per_rank, self.data_parallel_size)


@dataclass
class CacheConfig:
    num_kv_blocks: int = 512
    block_size: int = 16


@dataclass
class EngineConfig:
    model: str = "tiny-moe"
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    max_num_batched_tokens: int = 2048
    #: `--trace FILE`: write the overlap timeline of every step as Chrome trace-event JSON.
    trace_path: str | None = None
    #: `--device auto|cpu|cuda` and `--dtype auto|bfloat16|float16|float32`, resolved per
    #: rank by `resolve_device` / `resolve_dtype` (auto: CUDA + bf16 when available, else CPU + fp32).
    device: str = "auto"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        from tandem.platform.device import check_device_flag, check_dtype_flag

        check_device_flag(self.device)
        check_dtype_flag(self.dtype)
        if self.overlap.graph_mode == "full":
            from tandem.modular_kernels.capturable import check_backend_graph_capturable

            check_backend_graph_capturable(self.parallel.all2all_backend, self.parallel.moe_backend)
        if self.parallel.all2all_backend == "deepep_low_latency":
            from tandem.modular_kernels.prepare_deepep import check_low_latency_step_budget

            check_low_latency_step_budget(self.max_num_batched_tokens, self.parallel.deepep_ll_max_tokens_per_rank)

    def resolve_device(self, local_rank: int = 0):
        from tandem.platform.device import resolve_device

        return resolve_device(self.device, local_rank)

    def resolve_dtype(self, device):
        from tandem.platform.device import resolve_dtype

        return resolve_dtype(self.dtype, device)
