"""One configuration tree shared by the CLI and the library.

Every setting a user can change is a dataclass field here, declared once with `option(...)`:
its default, its help text and (where it differs from the field name) its flag live in the
field's metadata, and `tandem.cli` generates the command-line options from them. A command
declares which sections it takes; nothing else repeats a flag or its default.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

EXECUTORS = ("thread", "greenlet", "stages")
GRAPH_MODES = ("auto", "none", "full")
#: `--compile`: `auto` decides per device and dtype (tandem.models.compiled.compile_default).
COMPILE_MODES = ("auto", "on", "off")
#: `static`: the two token thresholds decide; `auto`: the overlap planner (tandem.ubatch.planner).
OVERLAP_POLICIES = ("static", "auto")
#: Where a DBO step is cut: at the token midpoint, or where the ubatches' predicted costs match.
UBATCH_SPLITS = ("tokens", "balanced-cost")


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    cli_type: type | None = None,
    parse: Callable[[Any], Any] | None = None,
    metavar: str | None = None,
    envvar: str | None = None,
    hidden: bool = False,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A configuration field that is also a command-line option.

    `flag`: the option's declaration when it is not `--field-name` (e.g. "--trace", or
    "--overlap-schedule/--disable-overlap-schedule" for a switch); `cli_type` + `parse`: the
    type the command line takes and how it becomes the field's value (e.g. "10,14" -> (10, 14))."""
    metadata = {
        "help": help, "flag": flag, "cli_type": cli_type, "parse": parse, "metavar": metavar, "envvar": envvar,
        "hidden": hidden,
    }
    if default_factory is not None:
        return field(default_factory=default_factory, metadata={"cli": metadata})
    return field(default=default, metadata={"cli": metadata})


def cli_fields(section: type) -> list:
    """The fields of a config dataclass that are command-line options, in declaration order."""
    return [f for f in fields(section) if "cli" in f.metadata]


def parse_int_tuple(text: str | tuple | list | None) -> tuple[int, ...] | None:
    """'10,14' -> (10, 14); a tuple or list passes through."""
    if text is None or isinstance(text, (tuple, list)):
        return None if text is None else tuple(int(v) for v in text)
    try:
        values = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"expected comma-separated integers, got {text!r}")
    return values


@dataclass
class OverlapConfig:
    """When and how a step is split into ubatches (DBO)."""

    enable_dbo: bool = option(False, "Split large steps into ubatches that overlap communication.")
    #: SGLang's spelling of DBO with the stages executor; kept as its own switch so a
    #: contradicting --ubatch-executor is an error rather than silently overridden.
    enable_two_batch_overlap: bool = option(
        False, "SGLang's name for two-batch overlap: the same as --enable-dbo --ubatch-executor stages."
    )
    num_ubatches: int = option(2, "Ubatches per DBO step.")
    executor: str = option(
        "thread", "thread | greenlet | stages (TBO: operation lists, no threads)", flag="--ubatch-executor"
    )
    tbo_token_distribution_threshold: float = option(
        0.48, "TBO prefill split: cut inside a sequence when no sequence boundary gives each ubatch this share."
    )
    dbo_decode_token_threshold: int = option(32, "Smallest uniform-decode step that uses DBO.")
    dbo_prefill_token_threshold: int = option(512, "Smallest other step that uses DBO.")
    #: The `tandem tune` file the thresholds came from; `auto` starts from its sweep.
    thresholds_file: str | None = option(
        None, "JSON from `tandem tune`; overrides the two thresholds (static) or seeds the planner (auto)."
    )
    overlap_policy: str = option(
        "static",
        "static (the two token thresholds decide) | auto (per step, the fastest of no overlap, SBO and DBO with "
        "2..N ubatches as predicted by a cost model fitted to the measured step times; needs --enable-dbo for DBO).",
    )
    ubatch_split: str = option(
        "tokens", "tokens (cut at the token midpoint) | balanced-cost (equal predicted work: attention + MoE tokens)."
    )
    graph_mode: str = option("auto", "auto | none | full (decode replayed from graphs captured at start-up; "
                             "auto: full on CUDA when the MoE backends can be captured and the step is not compiled)")
    comm_sms: int | None = option(
        None, "GPU SMs reserved for DeepEP while ubatches overlap (even); DeepGEMM gets the rest."
    )
    #: Share of steps the planner runs a choice other than its best (at most 0.05).
    planner_explore_share: float = 0.03

    def __post_init__(self) -> None:
        if self.enable_two_batch_overlap:
            if self.executor not in ("thread", "stages"):  # "thread" is the default: not a choice
                raise ValueError(
                    f"--enable-two-batch-overlap runs the stages executor; it contradicts --ubatch-executor {self.executor}"
                )
            self.enable_dbo, self.executor = True, "stages"
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

    @property
    def greenlet_ubatches(self) -> bool:
        """DBO on greenlets, whose switch cannot cross C++ frames (the compiled step's ops)."""
        return self.enable_dbo and self.executor == "greenlet"

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


@dataclass
class CacheConfig:
    """The paged KV cache of one rank."""

    #: The blocks themselves; None: `kv_cache_tokens / block_size` plus the null block the
    #: runner reserves for padding rows.
    num_kv_blocks: int | None = None
    block_size: int = option(16, "Tokens per KV cache block.")
    kv_cache_tokens: int = option(32768, "KV cache size per rank, in tokens.")

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"--kv-cache-tokens ({self.kv_cache_tokens}) must hold at least one block of {self.block_size}"
            )
        if self.num_kv_blocks is None:
            self.num_kv_blocks = self.kv_cache_tokens // self.block_size + 1
        elif self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")

    @property
    def usable_tokens(self) -> int:
        """Tokens one rank's cache holds for requests (the runner keeps one block for padding)."""
        return (self.num_kv_blocks - 1) * self.block_size


@dataclass
class SchedulerConfig:
    """What the scheduler admits into a step, and how long a step may take."""

    max_num_seqs: int = option(64, "Most requests running at once per rank.")
    #: None: the model's own context length (the front end also caps it at one rank's KV cache).
    max_model_len: int | None = option(
        None,
        "Longest context (prompt + max_tokens) a request may use (default: the model's, capped by the KV cache); "
        "the front end and the ranks both refuse longer requests.",
    )
    #: None: on where it pays (`overlaps_schedule`).
    overlap_schedule: bool | None = option(
        None,
        "Overlap the CPU work of step N-1 (results, stop checks, scheduling) with the forward of step N; "
        "--disable-overlap-schedule runs them in sequence. Default: on, except on a CPU whose cores all "
        "run the forward (the overlapped work would take a core from it).",
        flag="--overlap-schedule/--disable-overlap-schedule",
    )
    #: 512 MB: vLLM's bound for the same cache.
    grammar_cache_mb: int = option(
        512,
        "Compiled grammars (response_format json_schema, tools) each rank keeps, in MB; the least recently used go "
        "first. A client that sends a new schema per call would otherwise grow the rank for good.",
    )
    step_timeout_s: float = option(
        300.0,
        "Seconds a rank may spend in one step before it is declared stuck and the engine unavailable "
        "(503); keep it well above the slowest normal step.",
        flag="--step-timeout",
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.grammar_cache_mb < 1:
            raise ValueError(f"--grammar-cache-mb must be >= 1, got {self.grammar_cache_mb}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"--step-timeout must be > 0, got {self.step_timeout_s}")

    def overlaps_schedule(self, device_type: str, forward_threads: int, cores: int) -> bool:
        """Whether the loop overlaps step N-1's CPU work with step N's forward. On the CPU the
        forward is the CPU: the overlapped work runs in a second thread and, when the forward's
        threads hold every core, stalls them at each parallel region's barrier (one rank on 2
        cores decoded at 15.6 ms/token overlapped against 11.6 ms in sequence)."""
        if self.overlap_schedule is not None:
            return self.overlap_schedule
        return device_type != "cpu" or forward_threads < cores

    def context_length(self, model_max_len: int) -> int:
        """The longest context a request may use: `--max-model-len`, or the model's own; the one
        place it is checked against the model. The front end also caps it by the KV cache
        (`CacheConfig.usable_tokens`)."""
        if self.max_model_len is None:
            return model_max_len
        if self.max_model_len > model_max_len:
            raise ValueError(f"--max-model-len {self.max_model_len} is over the model's context length {model_max_len}")
        return self.max_model_len


@dataclass
class HttpOptions:
    """`tandem serve`'s HTTP front end."""

    host: str = option("127.0.0.1", "Address to bind; loopback by default.")
    port: int = option(8000, "Port to bind.")
    api_key: str | None = option(None, "Require 'Authorization: Bearer KEY' on /v1.", envvar="TANDEM_API_KEY")
    served_model_name: str | None = option(None, "Model name clients use (default: the directory name).")
    max_queue_len: int | None = option(None, "Requests in flight before new ones get 429.")
    log_requests: bool = option(False, "Log request contents (off by default).")
    max_request_bytes: int = option(1_000_000, "Largest request body accepted; larger ones get 413.")
    max_streams_per_key: int | None = option(
        None, "Streaming requests open at once per API key (per client address without a key); more get 429."
    )

    shutdown_timeout: float = option(
        20.0, "On SIGTERM or SIGINT, how long the requests in flight get to finish (new ones get 503) before "
        "they end with an error and the server stops; a second signal stops at once."
    )

    def __post_init__(self) -> None:
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_streams_per_key is not None and self.max_streams_per_key < 1:
            raise ValueError(f"--max-streams-per-key must be >= 1, got {self.max_streams_per_key}")


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
