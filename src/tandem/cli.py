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
_UBATCH_EXECUTOR = typer.Option("thread", help="thread | greenlet")
_DBO_DECODE_THRESHOLD = typer.Option(32, help="Smallest uniform-decode step that uses DBO.")
_DBO_PREFILL_THRESHOLD = typer.Option(512, help="Smallest other step that uses DBO.")
_THRESHOLDS_FILE = typer.Option(None, help="JSON from `tandem tune`; overrides the two thresholds.")
_ENABLE_SBO = typer.Option(False, help="Overlap shared experts with the combine in flight.")
_ALL2ALL_BACKEND = typer.Option(
    None, help="local | torch_a2a | torch_a2a_ll | deepep_low_latency | deepep_high_throughput"
)
_MOE_BACKEND = typer.Option("torch", help="torch | triton | deep_gemm")
_GRAPH_MODE = typer.Option("none", help="none | full (decode steps replayed from captured graphs)")
_FABRIC_LATENCY_US = typer.Option(None, help="Modelled interconnect: per-transfer latency.")
_FABRIC_GBPS = typer.Option(None, help="Modelled interconnect: bandwidth in GB/s.")


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
    cache=None,
    max_num_batched_tokens: int = 2048,
):
    """The EngineConfig for the shared flags; a bad value raises `typer.BadParameter`."""
    from tandem.config import CacheConfig, EngineConfig, OverlapConfig, ParallelConfig

    try:
        return EngineConfig(
            model=model,
            overlap=OverlapConfig(
                enable_dbo=enable_dbo,
                num_ubatches=num_ubatches,
                executor=ubatch_executor,
                dbo_decode_token_threshold=dbo_decode_token_threshold,
                dbo_prefill_token_threshold=dbo_prefill_token_threshold,
                graph_mode=graph_mode,
            ).with_thresholds_file(thresholds_file),
            parallel=ParallelConfig(
                data_parallel_size=data_parallel_size,
                all2all_backend=all2all_backend,
                moe_backend=moe_backend,
                enable_sbo=enable_sbo,
                fabric_latency_us=fabric_latency_us,
                fabric_gbps=fabric_gbps,
            ),
            cache=cache or CacheConfig(),
            max_num_batched_tokens=max_num_batched_tokens,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command()
def generate(
    prompts: list[str] = typer.Argument(..., help="One or more prompts; completions are printed in the same order."),
    model: str = _MODEL,
    data_parallel_size: int = _DATA_PARALLEL_SIZE,
    enable_dbo: bool = _ENABLE_DBO,
    num_ubatches: int = _NUM_UBATCHES,
    ubatch_executor: str = _UBATCH_EXECUTOR,
    dbo_decode_token_threshold: int = _DBO_DECODE_THRESHOLD,
    dbo_prefill_token_threshold: int = _DBO_PREFILL_THRESHOLD,
    thresholds_file: str = _THRESHOLDS_FILE,
    enable_sbo: bool = _ENABLE_SBO,
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
    json_output: bool = typer.Option(False, "--json", help="One JSON object per prompt (text, token_ids) instead of text."),
) -> None:
    """Offline generation; completions go to stdout, logs and progress to stderr."""
    import json
    import sys
    import time

    from tandem.runner.sampling import SamplingParams

    config = _engine_config(
        model=model,
        data_parallel_size=data_parallel_size,
        enable_dbo=enable_dbo,
        num_ubatches=num_ubatches,
        ubatch_executor=ubatch_executor,
        dbo_decode_token_threshold=dbo_decode_token_threshold,
        dbo_prefill_token_threshold=dbo_prefill_token_threshold,
        thresholds_file=thresholds_file,
        enable_sbo=enable_sbo,
        all2all_backend=all2all_backend,
        moe_backend=moe_backend,
        graph_mode=graph_mode,
        fabric_latency_us=fabric_latency_us,
        fabric_gbps=fabric_gbps,
    )
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
        f"thresholds decode={o.dbo_decode_token_threshold} prefill={o.dbo_prefill_token_threshold}) "
        f"sbo={'on' if p.enable_sbo else 'off'} graph={o.graph_mode}"
    )
    start = time.perf_counter()
    from tandem.runner.launch import RankFailedError, launch_ranks
    from tandem.runner.offline import generate_on_rank

    try:
        if p.data_parallel_size == 1:
            per_rank = [generate_on_rank(0, 1, config, prompts, params)]
        else:
            per_rank = launch_ranks(generate_on_rank, p.data_parallel_size, config, prompts, params)
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
    num_ubatches: int = _NUM_UBATCHES,
    ubatch_executor: str = _UBATCH_EXECUTOR,
    dbo_decode_token_threshold: int = _DBO_DECODE_THRESHOLD,
    dbo_prefill_token_threshold: int = _DBO_PREFILL_THRESHOLD,
    thresholds_file: str = _THRESHOLDS_FILE,
    enable_sbo: bool = _ENABLE_SBO,
    all2all_backend: str = _ALL2ALL_BACKEND,
    moe_backend: str = _MOE_BACKEND,
    graph_mode: str = _GRAPH_MODE,
    fabric_latency_us: float = _FABRIC_LATENCY_US,
    fabric_gbps: float = _FABRIC_GBPS,
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
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (also runs under torchrun, one
    process per rank, for several nodes)."""
    from tandem.config import CacheConfig
    from tandem.serving.rank import ServeOptions
    from tandem.serving.server import HttpOptions, run_server, run_torchrun_rank, under_torchrun

    if under_torchrun():
        # torchrun decides the ranks: one process each, WORLD_SIZE of them.
        import os

        data_parallel_size = int(os.environ["WORLD_SIZE"])
    if kv_cache_tokens < block_size or block_size < 1:
        raise typer.BadParameter(f"--kv-cache-tokens ({kv_cache_tokens}) must hold at least one block of {block_size}")
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise typer.BadParameter("--max-num-seqs and --max-num-batched-tokens must be >= 1")
    config = _engine_config(
        model=model,
        data_parallel_size=data_parallel_size,
        enable_dbo=enable_dbo,
        num_ubatches=num_ubatches,
        ubatch_executor=ubatch_executor,
        dbo_decode_token_threshold=dbo_decode_token_threshold,
        dbo_prefill_token_threshold=dbo_prefill_token_threshold,
        thresholds_file=thresholds_file,
        enable_sbo=enable_sbo,
        all2all_backend=all2all_backend,
        moe_backend=moe_backend,
        graph_mode=graph_mode,
        fabric_latency_us=fabric_latency_us,
        fabric_gbps=fabric_gbps,
        # One more block: the runner reserves a null block for padding rows.
        cache=CacheConfig(num_kv_blocks=kv_cache_tokens // block_size + 1, block_size=block_size),
        max_num_batched_tokens=max_num_batched_tokens,
    )
    options = ServeOptions(max_num_seqs=max_num_seqs, overlap_schedule=not disable_overlap_schedule)
    http = HttpOptions(
        host=host,
        port=port,
        api_key=api_key,
        served_model_name=served_model_name,
        max_queue_len=max_queue_len,
        log_requests=log_requests,
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
