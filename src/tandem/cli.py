"""The `tandem` command line. Each command is added by the module that implements it."""

from __future__ import annotations

import sys

import typer

app = typer.Typer(
    name="tandem",
    help="Micro-batch overlap runtime for Mixture-of-Experts inference.",
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from tandem import __version__

        typer.echo(f"tandem {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Micro-batch overlap runtime for Mixture-of-Experts inference."""


# Options shared by every command that runs the engine (generate, serve, bench, tune).
_MODEL = typer.Option("tiny-moe", help="A Hugging Face model directory, or the built-in 'tiny-moe'.")
_DATA_PARALLEL_SIZE = typer.Option(1, help="DP ranks (processes); experts are sharded across them.")
_ENABLE_DBO = typer.Option(False, help="Split large steps into ubatches that overlap communication.")
_NUM_UBATCHES = typer.Option(2, help="Ubatches per DBO step.")
_UBATCH_EXECUTOR = typer.Option("thread", help="thread | greenlet | stages (TBO: operation lists, no threads)")
_ENABLE_TWO_BATCH_OVERLAP = typer.Option(
    False, help="SGLang's name for two-batch overlap: the same as --enable-dbo --ubatch-executor stages."
)
_TBO_THRESHOLD = typer.Option(
    0.48, help="TBO prefill split: cut inside a sequence when no sequence boundary gives each ubatch this share."
)
_DBO_DECODE_THRESHOLD = typer.Option(32, help="Smallest uniform-decode step that uses DBO.")
_DBO_PREFILL_THRESHOLD = typer.Option(512, help="Smallest other step that uses DBO.")
_THRESHOLDS_FILE = typer.Option(
    None, help="JSON from `tandem tune`; overrides the two thresholds (static) or seeds the planner (auto)."
)
_OVERLAP_POLICY = typer.Option(
    "static",
    help="static (the two token thresholds decide) | auto (per step, the fastest of no overlap, SBO and DBO with "
    "2..N ubatches as predicted by a cost model fitted to the measured step times; needs --enable-dbo for DBO).",
)
_UBATCH_SPLIT = typer.Option(
    "tokens", help="tokens (cut at the token midpoint) | balanced-cost (equal predicted work: attention + MoE tokens)."
)
_ENABLE_SBO = typer.Option(False, help="Single-batch overlap inside each MoE layer (see --sbo-mode).")
_SBO_MODE = typer.Option(
    "auto",
    help="auto | combine-down-gemm (the combine leaves block by block while the down projection runs) | "
    "combine-shared (shared experts while the combine is in flight) | dispatch-shared (shared experts while the "
    "dispatch is in flight); auto picks per backend as SGLang does.",
)
_ALL2ALL_BACKEND = typer.Option(
    None, help="local | torch_a2a | torch_a2a_ll | deepep_low_latency | deepep_high_throughput"
)
_MOE_BACKEND = typer.Option("torch", help="torch | triton | deep_gemm")
_GRAPH_MODE = typer.Option("none", help="none | full (decode steps replayed from captured graphs)")
_FABRIC_LATENCY_US = typer.Option(None, help="Modelled interconnect: per-transfer latency.")
_FABRIC_GBPS = typer.Option(None, help="Modelled interconnect: bandwidth in GB/s.")
_FABRIC = typer.Option(
    None, help="Modelled interconnect preset, e.g. deepep-ll-h800 (DeepEP low-latency, H800, EP8) or deepep-ll-h800-ep64."
)
_TRACE = typer.Option(
    None, "--trace", metavar="FILE",
    help="Write the overlap timeline (steps, each ubatch's compute, receive waits, switches, transfers; one process "
    "per rank) as Chrome trace-event JSON: open it in ui.perfetto.dev or chrome://tracing. serve writes it when "
    "stopped. Off by default.",
)
_DEVICE = typer.Option(
    "auto", help="auto | cpu | cuda (auto: CUDA when available; rank i of a host takes cuda:{i % GPUs})."
)
_DTYPE = typer.Option("auto", help="auto | bfloat16 | float16 | float32 (auto: bfloat16 on CUDA, float32 on CPU).")
_DEEPEP_LL_MAX_TOKENS_PER_RANK = typer.Option(
    128,
    help="Tokens per rank deepep_low_latency's buffer holds (DeepEP needs (T+1)*2 <= NVSHMEM_QP_DEPTH and "
    "ranks*T divisible by 4); separate from the step's token budget.",
)
_COMM_SMS = typer.Option(None, help="GPU SMs reserved for DeepEP while ubatches overlap (even); DeepGEMM gets the rest.")

_PIPELINE_PARALLEL_SIZE = typer.Option(1, help="Pipeline stages (processes); the decoder layers are split over them.")
_PP_LAYER_PARTITION = typer.Option(None, help="Decoder layers per pipeline stage, e.g. 10,14 (default: even).")
_PP_ASYNC_BATCH_DEPTH = typer.Option(0, help="Micro-batches in flight beyond one per pipeline stage.")
_ENABLE_DYNAMIC_CHUNKING = typer.Option(
    False, help="Size prompt chunks from a latency model fitted at start-up, so each chunk costs about the same."
)


#: The shared engine flags, by parameter name: commands declare them (typer needs each
#: parameter spelled out) and hand them over with `_engine_flags(locals())`.
_ENGINE_FLAGS = (
    "model",
    "data_parallel_size",
    "enable_dbo",
    "enable_two_batch_overlap",
    "num_ubatches",
    "ubatch_executor",
    "tbo_token_distribution_threshold",
    "dbo_decode_token_threshold",
    "dbo_prefill_token_threshold",
    "thresholds_file",
    "overlap_policy",
    "ubatch_split",
    "enable_sbo",
    "sbo_mode",
    "all2all_backend",
    "moe_backend",
    "graph_mode",
    "fabric_latency_us",
    "fabric_gbps",
    "fabric",
    "trace",
    "device",
    "dtype",
    "deepep_ll_max_tokens_per_rank",
    "comm_sms",
    "pipeline_parallel_size",
    "pp_layer_partition",
    "pp_async_batch_depth",
    "enable_dynamic_chunking",
)


def _engine_flags(values: dict) -> dict:
    return {name: values[name] for name in _ENGINE_FLAGS}


def _engine_config(
    *,
    model: str,
    data_parallel_size: int,
    enable_dbo: bool,
    num_ubatches: int,
    ubatch_executor: str,
    dbo_decode_token_threshold: int,
    dbo_prefill_token_threshold: int,
    thresholds_file: str | None,
    enable_sbo: bool,
    all2all_backend: str | None,
    moe_backend: str,
    graph_mode: str,
    fabric_latency_us: float | None,
    fabric_gbps: float | None,
    fabric: str | None = None,
    trace: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    deepep_ll_max_tokens_per_rank: int = 128,
    comm_sms: int | None = None,
    pipeline_parallel_size: int = 1,
    pp_layer_partition: str | None = None,
    pp_async_batch_depth: int = 0,
    enable_dynamic_chunking: bool = False,
    enable_two_batch_overlap: bool = False,
    tbo_token_distribution_threshold: float = 0.48,
    sbo_mode: str = "auto",
    overlap_policy: str = "static",
    ubatch_split: str = "tokens",
    cache=None,
    max_num_batched_tokens: int = 2048,
):
    """The EngineConfig for the shared flags; a bad value raises `typer.BadParameter`, a
    device this machine lacks exits with one error line."""
    from tandem.config import CacheConfig, EngineConfig, OverlapConfig, ParallelConfig

    _check_device(device)
    if enable_two_batch_overlap:
        if ubatch_executor not in ("thread", "stages"):  # "thread" is the default: not a choice
            raise typer.BadParameter(
                f"--enable-two-batch-overlap runs the stages executor; it contradicts --ubatch-executor {ubatch_executor}"
            )
        enable_dbo, ubatch_executor = True, "stages"
    try:
        if pipeline_parallel_size > 1:
            _check_pipeline_partition(model, pipeline_parallel_size, pp_layer_partition)
        return EngineConfig(
            model=model,
            overlap=OverlapConfig(
                enable_dbo=enable_dbo,
                num_ubatches=num_ubatches,
                executor=ubatch_executor,
                dbo_decode_token_threshold=dbo_decode_token_threshold,
                dbo_prefill_token_threshold=dbo_prefill_token_threshold,
                graph_mode=graph_mode,
                comm_sms=comm_sms,
                tbo_token_distribution_threshold=tbo_token_distribution_threshold,
                overlap_policy=overlap_policy,
                ubatch_split=ubatch_split,
            ).with_thresholds_file(thresholds_file),
            parallel=ParallelConfig(
                data_parallel_size=data_parallel_size,
                all2all_backend=all2all_backend,
                moe_backend=moe_backend,
                enable_sbo=enable_sbo,
                sbo_mode=sbo_mode,
                fabric_latency_us=fabric_latency_us,
                fabric_gbps=fabric_gbps,
                fabric=fabric,
                deepep_ll_max_tokens_per_rank=deepep_ll_max_tokens_per_rank,
                pipeline_parallel_size=pipeline_parallel_size,
                pp_layer_partition=_int_list(pp_layer_partition, "--pp-layer-partition", sort=False) if pp_layer_partition else None,
                pp_async_batch_depth=pp_async_batch_depth,
                enable_dynamic_chunking=enable_dynamic_chunking,
            ),
            cache=cache or CacheConfig(),
            max_num_batched_tokens=max_num_batched_tokens,
            trace_path=trace,
            device=device,
            dtype=dtype,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _check_device(device: str) -> None:
    """`--device cuda` without CUDA: one error line on stderr and exit code 2, no traceback."""
    from tandem.platform.device import DeviceUnavailableError, check_device_flag

    try:
        check_device_flag(device)
    except DeviceUnavailableError as exc:
        print(f"[tandem] error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(code=2) from None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _check_pipeline_partition(model: str, stages: int, partition: str | None) -> None:
    """A partition that cannot fit the model fails here, before any rank starts."""
    from tandem.distributed import partition_layers
    from tandem.models.loader import num_hidden_layers

    try:
        layers = num_hidden_layers(model)
    except (OSError, KeyError):
        return  # a bad model directory gets its own error where it is loaded
    partition_layers(layers, stages, _int_list(partition, "--pp-layer-partition", sort=False) if partition else None)


@app.command()
def generate(
    prompts: list[str] = typer.Argument(..., help="One or more prompts; completions are printed in the same order."),
    model: str = _MODEL,
    data_parallel_size: int = _DATA_PARALLEL_SIZE,
    enable_dbo: bool = _ENABLE_DBO,
    enable_two_batch_overlap: bool = _ENABLE_TWO_BATCH_OVERLAP,
    num_ubatches: int = _NUM_UBATCHES,
    ubatch_executor: str = _UBATCH_EXECUTOR,
    tbo_token_distribution_threshold: float = _TBO_THRESHOLD,
    dbo_decode_token_threshold: int = _DBO_DECODE_THRESHOLD,
    dbo_prefill_token_threshold: int = _DBO_PREFILL_THRESHOLD,
    thresholds_file: str = _THRESHOLDS_FILE,
    overlap_policy: str = _OVERLAP_POLICY,
    ubatch_split: str = _UBATCH_SPLIT,
    enable_sbo: bool = _ENABLE_SBO,
    sbo_mode: str = _SBO_MODE,
    all2all_backend: str = _ALL2ALL_BACKEND,
    moe_backend: str = _MOE_BACKEND,
    graph_mode: str = _GRAPH_MODE,
    max_tokens: int = typer.Option(16, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: int = typer.Option(None, help="Sampling seed (per prompt)."),
    ignore_eos: bool = typer.Option(False, help="Keep generating past the end-of-sequence token."),
    fabric_latency_us: float = _FABRIC_LATENCY_US,
    fabric_gbps: float = _FABRIC_GBPS,
    fabric: str = _FABRIC,
    trace: str = _TRACE,
    device: str = _DEVICE,
    dtype: str = _DTYPE,
    deepep_ll_max_tokens_per_rank: int = _DEEPEP_LL_MAX_TOKENS_PER_RANK,
    comm_sms: int = _COMM_SMS,
    pipeline_parallel_size: int = _PIPELINE_PARALLEL_SIZE,
    pp_layer_partition: str = _PP_LAYER_PARTITION,
    pp_async_batch_depth: int = _PP_ASYNC_BATCH_DEPTH,
    enable_dynamic_chunking: bool = _ENABLE_DYNAMIC_CHUNKING,
    json_output: bool = typer.Option(False, "--json", help="One JSON object per prompt (text, token_ids) instead of text."),
) -> None:
    """Offline generation; completions go to stdout, logs and progress to stderr."""
    import json
    import sys
    import time

    from tandem.runner.sampling import SamplingParams

    config = _engine_config(**_engine_flags(locals()))
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, ignore_eos=ignore_eos
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None

    log = lambda msg: print(f"[tandem] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    o, p = config.overlap, config.parallel
    log(
        f"model={model} dp={p.data_parallel_size} all2all={p.all2all_backend} moe={p.moe_backend} "
        f"dbo={'on' if o.enable_dbo else 'off'} (ubatches={o.num_ubatches}, executor={o.executor}, "
        f"policy={o.overlap_policy} split={o.ubatch_split} "
        f"thresholds decode={o.dbo_decode_token_threshold} prefill={o.dbo_prefill_token_threshold}) "
        f"sbo={p.sbo_mode if p.enable_sbo else 'off'} graph={o.graph_mode} device={config.device} dtype={config.dtype}"
        + (f" pp={p.pipeline_parallel_size} (depth {p.pp_async_batch_depth})" if p.pipeline_parallel_size > 1 else "")
    )
    start = time.perf_counter()
    from tandem.runner.launch import RankFailedError, launch_ranks
    from tandem.runner.offline import generate_on_rank

    try:
        if p.world_size == 1:
            per_rank = [generate_on_rank(0, 1, config, prompts, params)]
        else:
            per_rank = launch_ranks(generate_on_rank, p.world_size, config, prompts, params, device=config.device)
    except (ValueError, ImportError, OSError) as exc:
        log(f"error: {exc}")
        raise typer.Exit(code=2) from None
    except RankFailedError as exc:
        # The rank's traceback is in the message; its last line is the error itself.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        log(f"error: {lines[-1] if lines else exc}")
        raise typer.Exit(code=1) from None
    completions = sorted((c for rank in per_rank for c in rank), key=lambda c: c.index)
    tokens = sum(len(c.token_ids) for c in completions)
    log(f"generated {tokens} tokens for {len(completions)} prompts in {time.perf_counter() - start:.2f} s")
    for c in completions:
        if json_output:
            print(json.dumps({"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
        else:
            print(c.text.replace("\\", "\\\\").replace("\n", "\\n"))


@app.command()
def serve(
    model: str = typer.Argument("tiny-moe", help="A Hugging Face model directory, or the built-in 'tiny-moe'."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; loopback by default."),
    port: int = typer.Option(8000),
    data_parallel_size: int = _DATA_PARALLEL_SIZE,
    enable_dbo: bool = _ENABLE_DBO,
    enable_two_batch_overlap: bool = _ENABLE_TWO_BATCH_OVERLAP,
    num_ubatches: int = _NUM_UBATCHES,
    ubatch_executor: str = _UBATCH_EXECUTOR,
    tbo_token_distribution_threshold: float = _TBO_THRESHOLD,
    dbo_decode_token_threshold: int = _DBO_DECODE_THRESHOLD,
    dbo_prefill_token_threshold: int = _DBO_PREFILL_THRESHOLD,
    thresholds_file: str = _THRESHOLDS_FILE,
    overlap_policy: str = _OVERLAP_POLICY,
    ubatch_split: str = _UBATCH_SPLIT,
    enable_sbo: bool = _ENABLE_SBO,
    sbo_mode: str = _SBO_MODE,
    all2all_backend: str = _ALL2ALL_BACKEND,
    moe_backend: str = _MOE_BACKEND,
    graph_mode: str = _GRAPH_MODE,
    fabric_latency_us: float = _FABRIC_LATENCY_US,
    fabric_gbps: float = _FABRIC_GBPS,
    fabric: str = _FABRIC,
    trace: str = _TRACE,
    device: str = _DEVICE,
    dtype: str = _DTYPE,
    deepep_ll_max_tokens_per_rank: int = _DEEPEP_LL_MAX_TOKENS_PER_RANK,
    comm_sms: int = _COMM_SMS,
    pipeline_parallel_size: int = _PIPELINE_PARALLEL_SIZE,
    pp_layer_partition: str = _PP_LAYER_PARTITION,
    pp_async_batch_depth: int = _PP_ASYNC_BATCH_DEPTH,
    enable_dynamic_chunking: bool = _ENABLE_DYNAMIC_CHUNKING,
    max_num_seqs: int = typer.Option(64, help="Most requests running at once per rank."),
    max_num_batched_tokens: int = typer.Option(2048, help="Token budget of one step (prefill is chunked to fit)."),
    kv_cache_tokens: int = typer.Option(32768, help="KV cache size per rank, in tokens."),
    block_size: int = typer.Option(16, help="Tokens per KV cache block."),
    disable_overlap_schedule: bool = typer.Option(
        False, help="Run schedule → forward → results in sequence instead of overlapping them."
    ),
    api_key: str = typer.Option(None, envvar="TANDEM_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1."),
    served_model_name: str = typer.Option(None, help="Model name clients use (default: the directory name)."),
    max_queue_len: int = typer.Option(None, help="Requests in flight before new ones get 429."),
    log_requests: bool = typer.Option(False, help="Log request contents (off by default)."),
    max_model_len: int = typer.Option(
        None, help="Longest context (prompt + max_tokens) a request may use (default: the model's, capped by the KV cache)."
    ),
    max_request_bytes: int = typer.Option(1_000_000, help="Largest request body accepted; larger ones get 413."),
    max_streams_per_key: int = typer.Option(
        None, help="Streaming requests open at once per API key (per client address without a key); more get 429."
    ),
    step_timeout: float = typer.Option(
        300.0, help="Seconds a rank may spend in one step before it is declared stuck and the engine unavailable "
        "(503); keep it well above the slowest normal step."
    ),
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (also runs under torchrun, one
    process per rank, for several nodes)."""
    from tandem.config import CacheConfig
    from tandem.serving.rank import ServeOptions
    from tandem.serving.server import HttpOptions, run_server, run_torchrun_rank, under_torchrun

    if under_torchrun():
        # torchrun decides the ranks: one process each, WORLD_SIZE of them.
        import os

        data_parallel_size = int(os.environ["WORLD_SIZE"]) // max(pipeline_parallel_size, 1)
    if kv_cache_tokens < block_size or block_size < 1:
        raise typer.BadParameter(f"--kv-cache-tokens ({kv_cache_tokens}) must hold at least one block of {block_size}")
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise typer.BadParameter("--max-num-seqs and --max-num-batched-tokens must be >= 1")
    if max_request_bytes < 1:
        raise typer.BadParameter(f"--max-request-bytes must be >= 1, got {max_request_bytes}")
    if max_streams_per_key is not None and max_streams_per_key < 1:
        raise typer.BadParameter(f"--max-streams-per-key must be >= 1, got {max_streams_per_key}")
    if not step_timeout > 0:
        raise typer.BadParameter(f"--step-timeout must be > 0, got {step_timeout}")
    if max_model_len is not None and max_model_len < 2:
        raise typer.BadParameter(f"--max-model-len must be >= 2, got {max_model_len}")
    config = _engine_config(
        **_engine_flags(locals()),
        # One more block: the runner reserves a null block for padding rows.
        cache=CacheConfig(num_kv_blocks=kv_cache_tokens // block_size + 1, block_size=block_size),
        max_num_batched_tokens=max_num_batched_tokens,
    )
    options = ServeOptions(
        max_num_seqs=max_num_seqs,
        overlap_schedule=not disable_overlap_schedule,
        step_timeout_s=step_timeout,
        max_model_len=max_model_len,
    )
    http = HttpOptions(
        host=host,
        port=port,
        api_key=api_key,
        served_model_name=served_model_name,
        max_queue_len=max_queue_len,
        log_requests=log_requests,
        max_request_bytes=max_request_bytes,
        max_streams_per_key=max_streams_per_key,
    )
    try:
        from tandem.models.loader import load_tokenizer_info

        load_tokenizer_info(model)  # a bad model directory fails here, before any rank starts
        if under_torchrun():
            run_torchrun_rank(config, options, http)
        else:
            run_server(config, options, http)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"[tandem] error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(code=1) from None
    except KeyboardInterrupt:
        raise typer.Exit(code=130) from None


# -- tandem bench / tandem tune ------------------------------------------------------------

_BENCH_DATA_PARALLEL_SIZE = typer.Option(2, help="Ranks (processes); experts are sharded across them.")
_BENCH_FABRIC = typer.Option(
    None,
    help="Modelled interconnect: a preset (deepep-ll-h800, deepep-ll-h800-ep64, ...) or 'calibrated' "
    "(bandwidth found so communication ≈ compute at the largest size).",
)
_BENCH_REPEAT = typer.Option(5, help="Timed runs per point (median reported); modes are interleaved.")
_BENCH_WARMUP = typer.Option(2, help="Untimed runs per point first.")
_BENCH_CONTEXT_LEN = typer.Option(128, help="Decode: cached tokens each request attends over.")
_BENCH_PREFILL_LEN = typer.Option(512, help="Prefill: new tokens per request (a batch is several).")


def _int_list(text: str, flag: str, *, sort: bool = True) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
        values = sorted(set(values)) if sort else values
    except ValueError:
        raise typer.BadParameter(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise typer.BadParameter(f"{flag} needs token counts >= 1, got {text!r}")
    return values


def _bench_spec(*, model, data_parallel_size, grids, modes, repeat, warmup, fabric, fabric_latency_us, fabric_gbps,
                num_ubatches, all2all_backend, moe_backend, context_len, prefill_len, trace=False, device="auto",
                dtype="auto", tbo_token_distribution_threshold=0.48, ubatch_split="tokens", thresholds_file=None):
    from tandem.bench.sweep import CALIBRATED, BenchSpec
    from tandem.bench.workloads import MOE_STACK
    from tandem.platform.device import resolve_device

    _check_device(device)
    on_gpu = resolve_device(device).type == "cuda"
    if model == MOE_STACK and on_gpu:
        raise typer.BadParameter("--model moe-stack runs on CPU only; bench a model step (tiny-moe, a directory) with --device cuda")
    if repeat < 1 or warmup < 0:
        raise typer.BadParameter("--repeat must be >= 1 and --warmup >= 0")
    if fabric is not None and fabric != CALIBRATED:
        from tandem.modular_kernels.fabric import FABRIC_PRESETS

        if fabric not in FABRIC_PRESETS:
            raise typer.BadParameter(f"unknown --fabric {fabric!r}; known: calibrated, {', '.join(sorted(FABRIC_PRESETS))}")
    modelled = fabric is not None or fabric_latency_us is not None or fabric_gbps is not None
    if modelled and data_parallel_size < 2 and not on_gpu:
        # On a GPU one rank models its transfers as spin kernels on the comm stream instead.
        raise typer.BadParameter("a modelled interconnect needs --data-parallel-size >= 2 (one rank has no all-to-all)")
    engine = None
    if model != MOE_STACK:
        engine = _engine_config(
            model=model, data_parallel_size=data_parallel_size, enable_dbo=False, num_ubatches=num_ubatches,
            ubatch_executor="thread", dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0,
            thresholds_file=thresholds_file, enable_sbo=False, all2all_backend=all2all_backend, moe_backend=moe_backend,
            graph_mode="none", fabric_latency_us=None, fabric_gbps=None, device=device, dtype=dtype,
            tbo_token_distribution_threshold=tbo_token_distribution_threshold, ubatch_split=ubatch_split,
        )
    return BenchSpec(
        model=model, data_parallel_size=data_parallel_size, grids=grids, modes=modes, repeat=repeat, warmup=warmup,
        fabric=fabric, fabric_latency_us=fabric_latency_us, fabric_gbps=fabric_gbps, num_ubatches=num_ubatches,
        all2all_backend=all2all_backend, context_len=context_len, prefill_len=prefill_len, engine_config=engine,
        trace=trace, device=device, dtype=dtype, ubatch_split=ubatch_split, thresholds_file=thresholds_file,
    )


def _run_bench_sweep(spec):
    from tandem.bench import run_sweep
    from tandem.runner.launch import RankFailedError

    try:
        return run_sweep(spec)
    except RankFailedError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        print(f"[tandem] error: {lines[-1] if lines else exc}", file=sys.stderr, flush=True)
        raise typer.Exit(code=1) from None


def _describe_transport(spec, result) -> str:
    fabric = result.get("fabric")
    if fabric is None:
        return "real gloo transport" if spec.data_parallel_size > 1 else "one rank, no all-to-all"
    name = f"--fabric {spec.fabric}: " if spec.fabric else ""
    return f"modelled interconnect ({name}{fabric['latency_us']:.1f} µs + bytes / {fabric['gbps']:.4g} GB/s)"


@app.command()
def bench(
    model: str = typer.Option(
        "tiny-moe",
        help="What one step runs: a model step of 'tiny-moe' or a Hugging Face directory (ModelRunner.execute, the "
        "serving path), or 'moe-stack' (4 synthetic MoE layers, hidden 1024, top-2 of 8 experts + a shared expert).",
    ),
    data_parallel_size: int = _BENCH_DATA_PARALLEL_SIZE,
    tokens: str = typer.Option("32,128,512", help="Tokens per rank to sweep, comma-separated."),
    modes: str = typer.Option(
        "none,dbo,dbo-greenlet,sbo,dbo+sbo",
        help="none | dbo (threads) | dbo-greenlet | sbo (--sbo-mode auto) | dbo+sbo | sbo-combine-down-gemm | "
        "sbo-combine-shared | sbo-dispatch-shared (one SGLang SBO mode each) | tbo (two-batch overlap: the stage "
        "executor, SGLang's operation strategies, no threads) | auto (the overlap planner picks none or DBO per "
        "step; it learns over the run, exploring up to 3% of steps).",
    ),
    phase: str = typer.Option("decode", help="decode (one new token per request) | prefill (long requests)."),
    repeat: int = _BENCH_REPEAT,
    warmup: int = _BENCH_WARMUP,
    fabric: str = _BENCH_FABRIC,
    fabric_latency_us: float = _FABRIC_LATENCY_US,
    fabric_gbps: float = _FABRIC_GBPS,
    num_ubatches: int = _NUM_UBATCHES,
    tbo_token_distribution_threshold: float = _TBO_THRESHOLD,
    all2all_backend: str = _ALL2ALL_BACKEND,
    moe_backend: str = _MOE_BACKEND,
    context_len: int = _BENCH_CONTEXT_LEN,
    prefill_len: int = _BENCH_PREFILL_LEN,
    device: str = _DEVICE,
    dtype: str = _DTYPE,
    ubatch_split: str = _UBATCH_SPLIT,
    thresholds_file: str = _THRESHOLDS_FILE,
    json_path: str = typer.Option(None, "--json", help="Write the rows and the settings to this JSON file."),
    plot: str = typer.Option(None, help="Write a PNG plot of step time against tokens per rank (needs matplotlib)."),
    trace: str = _TRACE,
    timeline: str = typer.Option(
        None, "--timeline", metavar="PNG",
        help="Draw one overlapped step (the last DBO step of the largest size) as lanes per rank x ubatch plus "
        "transfers (needs matplotlib).",
    ),
) -> None:
    """Step time of no overlap, DBO, SBO against tokens per rank on N local ranks, next to the
    floor max(compute, communication) measured in the same run, with the runtime's time model
    (exposed receive wait, ubatch switch time, overlap efficiency). Times are the slowest
    rank's; the table shows the median and the min and max over --repeat runs."""
    from tandem.bench import rows_from_sweep, write_json, write_plot
    from tandem.bench.report import check_plot_available, format_table
    from tandem.bench.workloads import MODES, PHASES

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in mode_list if m not in MODES]
    if unknown or not mode_list:
        raise typer.BadParameter(f"unknown mode(s) {unknown}; pick from {', '.join(MODES)}")
    if phase not in PHASES:
        raise typer.BadParameter(f"--phase must be one of {', '.join(PHASES)}")
    if plot is not None or timeline is not None:
        try:
            check_plot_available()
        except RuntimeError as exc:
            raise typer.BadParameter(str(exc)) from None
    spec = _bench_spec(
        model=model, data_parallel_size=data_parallel_size, grids=[(phase, _int_list(tokens, "--tokens"))],
        modes=mode_list, repeat=repeat, warmup=warmup, fabric=fabric, fabric_latency_us=fabric_latency_us,
        fabric_gbps=fabric_gbps, num_ubatches=num_ubatches, all2all_backend=all2all_backend, moe_backend=moe_backend,
        context_len=context_len, prefill_len=prefill_len, trace=trace is not None or timeline is not None,
        device=device, dtype=dtype, tbo_token_distribution_threshold=tbo_token_distribution_threshold,
        ubatch_split=ubatch_split, thresholds_file=thresholds_file,
    )
    result = _run_bench_sweep(spec)
    rows = rows_from_sweep(result, phase, mode_list)
    transport = _describe_transport(spec, result)
    title = f"{model}, {phase}, {data_parallel_size} ranks, {num_ubatches} ubatches, {transport}"
    print(title)
    print(format_table(rows))
    config = {**spec.config_dict(), "phase": phase, "fabric_model": result.get("fabric"), "transport": transport}
    if json_path:
        print(f"wrote {write_json(json_path, rows, config)}", file=sys.stderr)
    if plot:
        print(f"wrote {write_plot(plot, rows, title)}", file=sys.stderr)
    if trace:
        from tandem.contexts.trace import write_trace

        print(f"wrote {write_trace(trace, result['trace'])}", file=sys.stderr)
    if timeline:
        from tandem.bench.timeline import pick_step, write_timeline

        step = pick_step(result["trace"])
        print(f"wrote {write_timeline(timeline, result['trace'], step=step, title=f'{title}: step {step}')}", file=sys.stderr)


@app.command()
def tune(
    output: str = typer.Option("dbo_thresholds.json", help="Thresholds file for serve/generate --thresholds-file."),
    margin: float = typer.Option(0.03, help="DBO must be at least this much faster (0.03 = 3%)."),
    model: str = typer.Option("tiny-moe", help="'tiny-moe', a Hugging Face directory, or 'moe-stack' (see bench)."),
    data_parallel_size: int = _BENCH_DATA_PARALLEL_SIZE,
    decode_tokens: str = typer.Option("8,16,32,64,128,256", help="Decode batch sizes (tokens per rank) to sweep."),
    prefill_tokens: str = typer.Option("64,128,256,512,1024,2048", help="Prefill sizes (tokens per rank) to sweep."),
    ubatch_executor: str = _UBATCH_EXECUTOR,
    enable_two_batch_overlap: bool = _ENABLE_TWO_BATCH_OVERLAP,
    tbo_token_distribution_threshold: float = _TBO_THRESHOLD,
    repeat: int = _BENCH_REPEAT,
    warmup: int = _BENCH_WARMUP,
    fabric: str = _BENCH_FABRIC,
    fabric_latency_us: float = _FABRIC_LATENCY_US,
    fabric_gbps: float = _FABRIC_GBPS,
    num_ubatches: int = _NUM_UBATCHES,
    all2all_backend: str = _ALL2ALL_BACKEND,
    moe_backend: str = _MOE_BACKEND,
    context_len: int = _BENCH_CONTEXT_LEN,
    prefill_len: int = _BENCH_PREFILL_LEN,
    device: str = _DEVICE,
    dtype: str = _DTYPE,
    ubatch_split: str = _UBATCH_SPLIT,
) -> None:
    """Sweep decode and prefill steps with and without DBO, pick for each phase the smallest
    token count from which DBO beats no overlap by --margin at every larger size tried, and
    write the thresholds (JSON with dbo_decode_token_threshold and dbo_prefill_token_threshold)."""
    import json
    from pathlib import Path

    from tandem.bench.report import rows_from_sweep
    from tandem.bench.tune import NEVER, choose_threshold, format_decisions, paired_ratio

    if not 0 <= margin < 1:
        raise typer.BadParameter(f"--margin must be in [0, 1), got {margin}")
    if enable_two_batch_overlap:
        ubatch_executor = "stages"
    modes_of = {"thread": "dbo", "greenlet": "dbo-greenlet", "stages": "tbo"}
    if ubatch_executor not in modes_of:
        raise typer.BadParameter(f"--ubatch-executor must be one of {', '.join(modes_of)}")
    dbo_mode = modes_of[ubatch_executor]
    grids = [("decode", _int_list(decode_tokens, "--decode-tokens")), ("prefill", _int_list(prefill_tokens, "--prefill-tokens"))]
    spec = _bench_spec(
        model=model, data_parallel_size=data_parallel_size, grids=grids, modes=["none", dbo_mode], repeat=repeat,
        warmup=warmup, fabric=fabric, fabric_latency_us=fabric_latency_us, fabric_gbps=fabric_gbps,
        num_ubatches=num_ubatches, all2all_backend=all2all_backend, moe_backend=moe_backend,
        context_len=context_len, prefill_len=prefill_len, device=device, dtype=dtype,
        tbo_token_distribution_threshold=tbo_token_distribution_threshold, ubatch_split=ubatch_split,
    )
    result = _run_bench_sweep(spec)
    decisions = []
    for phase, _ in grids:
        rows = rows_from_sweep(result, phase, ["none", dbo_mode])
        by_tokens: dict[int, dict[str, float]] = {}
        for r in rows:
            by_tokens.setdefault(r["tokens_per_rank"], {})[r["mode"]] = r["step_ms"]
        cells = result["phases"][phase]
        sizes = [(t, v["none"], v[dbo_mode], paired_ratio(cells[t]["none"], cells[t][dbo_mode])) for t, v in by_tokens.items()]
        decisions.append(choose_threshold(phase, sizes, margin))
    print(f"{model}, {data_parallel_size} ranks, {num_ubatches} ubatches ({ubatch_executor}), {_describe_transport(spec, result)}")
    print(format_decisions(decisions))
    decode, prefill = decisions
    data = {
        "dbo_decode_token_threshold": decode.threshold,
        "dbo_prefill_token_threshold": prefill.threshold,
        "margin": margin,
        "config": {**spec.config_dict(), "fabric_model": result.get("fabric")},
        "sweep": {d.phase: [{"tokens_per_rank": t, "none_ms": n, "dbo_ms": b, "paired_speedup": round(x, 4), "dbo_wins": w}
                        for t, n, b, x, w in d.table]
                  for d in decisions},
    }
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    show = lambda t: "never" if t == NEVER else str(t)  # noqa: E731
    print(f"recommended: --enable-dbo --dbo-decode-token-threshold {decode.threshold} "
          f"--dbo-prefill-token-threshold {prefill.threshold}  (decode {show(decode.threshold)}, prefill {show(prefill.threshold)})")
    print(f"or: --thresholds-file {path}")
    print(f"wrote {path}", file=sys.stderr)
