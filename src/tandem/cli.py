"""The `tandem` command line. Each command is added by the module that implements it."""

from __future__ import annotations

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


@app.command()
def generate(
    prompts: list[str] = typer.Argument(..., help="One or more prompts; completions are printed in the same order."),
    model: str = typer.Option("tiny-moe", help="A Hugging Face model directory, or the built-in 'tiny-moe'."),
    data_parallel_size: int = typer.Option(1, help="DP ranks (processes); experts are sharded across them."),
    enable_dbo: bool = typer.Option(False, help="Split large steps into ubatches that overlap communication."),
    num_ubatches: int = typer.Option(2, help="Ubatches per DBO step."),
    ubatch_executor: str = typer.Option("thread", help="thread | greenlet"),
    dbo_decode_token_threshold: int = typer.Option(32, help="Smallest uniform-decode step that uses DBO."),
    dbo_prefill_token_threshold: int = typer.Option(512, help="Smallest other step that uses DBO."),
    thresholds_file: str = typer.Option(None, help="JSON from `tandem tune`; overrides the two thresholds."),
    enable_sbo: bool = typer.Option(False, help="Overlap shared experts with the combine in flight."),
    all2all_backend: str = typer.Option(None, help="local | torch_a2a | torch_a2a_ll | deepep_low_latency | deepep_high_throughput"),
    moe_backend: str = typer.Option("torch", help="torch | triton | deep_gemm"),
    graph_mode: str = typer.Option("none", help="none | full"),
    max_tokens: int = typer.Option(16, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: int = typer.Option(None, help="Sampling seed (per prompt)."),
    ignore_eos: bool = typer.Option(False, help="Keep generating past the end-of-sequence token."),
    fabric_latency_us: float = typer.Option(None, help="Modelled interconnect: per-transfer latency."),
    fabric_gbps: float = typer.Option(None, help="Modelled interconnect: bandwidth in GB/s."),
    json_output: bool = typer.Option(False, "--json", help="One JSON object per prompt (text, token_ids) instead of text."),
) -> None:
    """Offline generation; completions go to stdout, logs and progress to stderr."""
    import json
    import sys
    import time

    from tandem.config import CacheConfig, EngineConfig, OverlapConfig, ParallelConfig
    from tandem.runner.sampling import SamplingParams

    try:
        config = EngineConfig(
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
            cache=CacheConfig(),
        )
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
