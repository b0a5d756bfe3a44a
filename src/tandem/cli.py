"""The `tandem` command line. Each command is added by the module that implements it."""

from __future__ import annotations

import sys

import typer

from tandem import tune_sweep
from tandem.cli_bench import (
    BENCH_CONTEXT_LEN, BENCH_DEFAULTS, BENCH_FLAGS, BENCH_HELPS, BENCH_PREFILL_LEN, BENCH_REPEAT, BENCH_WARMUP,
    TUNE_SIMULATE, auto_prior, bench_spec, describe_transport, int_list, print_simulation, run_bench_sweep,
    tune_simulated, write_thresholds,
)
from tandem.cli_config import build_config, one_model, torchrun_parallel, torchrun_world
from tandem.cli_options import ENGINE_SECTIONS, Flags, config_command

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


@app.command(short_help="Generate completions offline (stdout), on its own ranks or under torchrun.")
@config_command(*ENGINE_SECTIONS)
def generate(
    prompts: list[str] = typer.Argument(..., help="One or more prompts; completions are printed in the same order."),
    max_tokens: int = typer.Option(16, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: int = typer.Option(None, help="Sampling seed (per prompt)."),
    ignore_eos: bool = typer.Option(False, help="Keep generating past the end-of-sequence token."),
    json_output: bool = typer.Option(False, "--json", help="One JSON object per prompt (text, token_ids) instead of text."),
    flags: Flags = None,
) -> None:
    """Offline generation; completions go to stdout, logs and progress to stderr. Runs its
    ranks itself, or is one rank under torchrun (rank 0 prints)."""
    import json
    import time

    from tandem.simulate.serve_prior import with_simulated_prior
    from tandem.worker.sampling import SamplingParams

    config = build_config(flags, parallel=torchrun_parallel(flags))
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, ignore_eos=ignore_eos
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None

    torchrun = torchrun_world()
    is_head = torchrun is None or torchrun[0] == 0
    log = lambda msg: is_head and print(f"[tandem] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    log(config.describe() + (f" torchrun world={torchrun[1]}" if torchrun else ""))
    config = with_simulated_prior(config, torchrun=torchrun is not None, log=log)
    start = time.perf_counter()
    per_rank = _generate_on_ranks(config, prompts, params, torchrun, log)
    if not is_head:
        return
    completions = sorted((c for rank in per_rank for c in rank), key=lambda c: c.index)
    tokens = sum(len(c.token_ids) for c in completions)
    log(f"generated {tokens} tokens for {len(completions)} prompts in {time.perf_counter() - start:.2f} s")
    for c in completions:
        if json_output:
            print(json.dumps({"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
        else:
            print(c.text.replace("\\", "\\\\").replace("\n", "\\n"))


def _generate_on_ranks(config, prompts: list[str], params, torchrun: tuple[int, int] | None, log) -> list:
    """Each rank's completions: this process as one torchrun rank, alone, or the head of ranks
    it launches. A failure is logged and exits (2: bad input, 1: a rank failed)."""
    from tandem.distributed.launch import RankFailedError, launch_ranks
    from tandem.distributed.torchrun import run_torchrun_rank
    from tandem.engine.offline import generate_on_rank

    world_size = config.parallel.world_size
    try:
        if torchrun is not None:
            return run_torchrun_rank(generate_on_rank, config, prompts, params, world_size=world_size, device=config.device)
        if world_size == 1:
            return [generate_on_rank(0, 1, config, prompts, params)]
        return launch_ranks(generate_on_rank, world_size, config, prompts, params, device=config.device)
    except (ValueError, ImportError, OSError) as exc:
        log(f"error: {exc}")
        raise typer.Exit(code=2) from None
    except RankFailedError as exc:
        # The rank's traceback is in the message; its last line is the error itself.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        log(f"error: {lines[-1] if lines else exc}")
        raise typer.Exit(code=1) from None


@app.command(short_help="Serve a model over an OpenAI-compatible HTTP API.")
@config_command(
    *ENGINE_SECTIONS, "http", arguments=("model",), defaults={"model": None},
    helps={"model": "A Hugging Face model directory, or a built-in preset: tiny-moe (the default), small-moe, "
                    "deepseek-v2-lite-random. Or give it as --model."},
)
def serve(
    model_option: str = typer.Option(
        None, "--model", help="The model, as `vllm serve --model` takes it (the same as the MODEL argument)."
    ),
    flags: Flags = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (also runs under torchrun, one
    process per rank, for several nodes)."""
    from tandem.serving.ranks.rank import ServeOptions
    from tandem.serving.server import run_server, run_torchrun_rank, under_torchrun

    flags = flags.replace(model=one_model(flags["model"], model_option))
    config = build_config(flags, parallel=torchrun_parallel(flags))
    http = flags.http_options()
    options = ServeOptions()
    try:
        from tandem.models.loader import load_tokenizer_info

        load_tokenizer_info(config.model)  # a bad model directory fails here, before any rank starts
        from tandem.simulate.serve_prior import with_simulated_prior

        head = (torchrun_world() or (0,))[0] == 0  # under torchrun, rank 0 speaks for all
        log = lambda line: head and print(f"[tandem] {line}", file=sys.stderr, flush=True)  # noqa: E731
        config = with_simulated_prior(config, torchrun=under_torchrun(), log=log)
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

@app.command(short_help="Step time of each overlap mode against tokens per rank, beside the measured floor.")
@config_command(*ENGINE_SECTIONS, only=(*BENCH_FLAGS, "thresholds_file", "trace"), defaults=BENCH_DEFAULTS, helps=BENCH_HELPS)
def bench(
    tokens: str = typer.Option("32,128,512", help="Tokens per rank to sweep, comma-separated."),
    modes: str = typer.Option(
        "none,dbo,dbo-greenlet,sbo,dbo+sbo",
        help="none | dbo (threads) | dbo-greenlet | sbo (--sbo-mode auto) | dbo+sbo | sbo-combine-down-gemm | "
        "sbo-combine-shared | sbo-dispatch-shared (one SGLang SBO mode each) | tbo (two-batch overlap: the stage "
        "executor, SGLang's operation strategies, no threads) | auto (the overlap planner picks none or DBO per "
        "step; it learns over the run, exploring up to 3% of steps).",
    ),
    phase: str = typer.Option("decode", help="decode (one new token per request) | prefill (long requests)."),
    repeat: int = BENCH_REPEAT,
    warmup: int = BENCH_WARMUP,
    context_len: int = BENCH_CONTEXT_LEN,
    prefill_len: int = BENCH_PREFILL_LEN,
    json_path: str = typer.Option(None, "--json", help="Write the rows and the settings to this JSON file."),
    plot: str = typer.Option(None, help="Write a PNG plot of step time against tokens per rank (needs matplotlib)."),
    timeline: str = typer.Option(
        None, "--timeline", metavar="PNG",
        help="Draw one overlapped step (the last DBO step of the largest size) as lanes per rank x ubatch plus "
        "transfers (needs matplotlib).",
    ),
    flags: Flags = None,
) -> None:
    """Step time of no overlap, DBO, SBO against tokens per rank on N local ranks, next to the
    floor max(compute, communication) measured in the same run, with the runtime's time model
    (exposed receive wait, ubatch switch time, overlap efficiency). Times are the slowest
    rank's; the table shows the median and the min and max over --repeat runs. Under torchrun
    each process is one rank and rank 0 prints and writes the files."""
    from tandem.bench import rows_from_sweep
    from tandem.bench.report import format_table

    mode_list = _bench_modes(modes, phase, plots=plot is not None or timeline is not None)
    trace, token_list = flags["trace"], int_list(tokens, "--tokens")
    prior_of_auto = auto_prior(flags, mode_list, phase, token_list, context_len=context_len, prefill_len=prefill_len)
    with prior_of_auto as (prior_file, prior):
        spec = bench_spec(
            **{name: flags[name] for name in BENCH_FLAGS}, thresholds_file=prior_file,
            grids=[(phase, token_list)], modes=mode_list, repeat=repeat, warmup=warmup,
            context_len=context_len, prefill_len=prefill_len, trace=trace is not None or timeline is not None,
        )
        result = run_bench_sweep(spec)
    if result is None:
        return  # a torchrun rank other than 0
    model, data_parallel_size, num_ubatches = spec.model, spec.data_parallel_size, spec.num_ubatches
    rows = rows_from_sweep(result, phase, mode_list)
    transport = describe_transport(spec, result)
    title = f"{model}, {phase}, {data_parallel_size} ranks, {num_ubatches} ubatches, {transport}"
    print(title)
    print(format_table(rows))
    config = {**spec.config_dict(), "phase": phase, "fabric_model": result.get("fabric"), "transport": transport}
    if prior is not None:  # the simulated prior's file is gone with the run: keep its content
        config.update(thresholds_file=None, auto_prior=prior)
    _write_bench_files(result, rows, config, title, json_path=json_path, plot=plot, trace=trace, timeline=timeline)


def _bench_modes(modes: str, phase: str, plots: bool) -> list[str]:
    """`bench`'s --modes as a list, checked with --phase and, when a picture is asked for,
    that matplotlib is there, before any rank starts."""
    from tandem.bench.report import check_plot_available
    from tandem.bench.workloads import MODES, PHASES

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in mode_list if m not in MODES]
    if unknown or not mode_list:
        raise typer.BadParameter(f"unknown mode(s) {unknown}; pick from {', '.join(MODES)}")
    if phase not in PHASES:
        raise typer.BadParameter(f"--phase must be one of {', '.join(PHASES)}")
    if plots:
        try:
            check_plot_available()
        except RuntimeError as exc:
            raise typer.BadParameter(str(exc)) from None
    return mode_list


def _write_bench_files(result: dict, rows, config: dict, title: str, *, json_path, plot, trace, timeline) -> None:
    from tandem.bench import write_json, write_plot

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


@app.command(short_help="Sweep decode and prefill with and without DBO and write the DBO thresholds.")
@config_command(
    *ENGINE_SECTIONS, only=(*BENCH_FLAGS, "ubatch_executor", "enable_two_batch_overlap"),
    defaults=BENCH_DEFAULTS, helps=BENCH_HELPS,
)
def tune(
    output: str = typer.Option("dbo_thresholds.json", help="Thresholds file for serve/generate --thresholds-file."),
    margin: float = typer.Option(tune_sweep.MARGIN, help="DBO must be at least this much faster (0.03 = 3%)."),
    decode_tokens: str = typer.Option(tune_sweep.comma_list(tune_sweep.DECODE_TOKENS), help="Decode batch sizes (tokens per rank) to sweep."),
    prefill_tokens: str = typer.Option(tune_sweep.comma_list(tune_sweep.PREFILL_TOKENS), help="Prefill sizes (tokens per rank) to sweep."),
    repeat: int = BENCH_REPEAT,
    warmup: int = BENCH_WARMUP,
    context_len: int = BENCH_CONTEXT_LEN,
    prefill_len: int = BENCH_PREFILL_LEN,
    simulate: str = TUNE_SIMULATE,
    flags: Flags = None,
) -> None:
    """Sweep decode and prefill steps with and without DBO, pick for each phase the smallest
    token count from which DBO beats no overlap by --margin at every larger size tried, and
    write the thresholds (JSON with dbo_decode_token_threshold and dbo_prefill_token_threshold).
    Under torchrun each process is one rank and rank 0 writes the file. With --simulate the
    sweep is the simulator's prediction for that hardware instead (no rank starts)."""
    if not 0 <= margin < 1:
        raise typer.BadParameter(f"--margin must be in [0, 1), got {margin}")
    ubatch_executor = "stages" if flags["enable_two_batch_overlap"] else flags["ubatch_executor"]
    modes_of = {"thread": "dbo", "greenlet": "dbo-greenlet", "stages": "tbo"}
    if ubatch_executor not in modes_of:
        raise typer.BadParameter(f"--ubatch-executor must be one of {', '.join(modes_of)}")
    dbo_mode = modes_of[ubatch_executor]
    grids = [("decode", int_list(decode_tokens, "--decode-tokens")), ("prefill", int_list(prefill_tokens, "--prefill-tokens"))]
    if simulate is not None:
        tune_simulated(simulate, flags, output=output, grids=dict(grids), margin=margin,
                       contexts={"decode": context_len, "prefill": prefill_len})
        return
    spec = bench_spec(
        **{name: flags[name] for name in BENCH_FLAGS}, grids=grids, modes=["none", dbo_mode], repeat=repeat,
        warmup=warmup, context_len=context_len, prefill_len=prefill_len,
    )
    result = run_bench_sweep(spec)
    if result is None:
        return  # a torchrun rank other than 0
    model, data_parallel_size, num_ubatches = spec.model, spec.data_parallel_size, spec.num_ubatches
    decisions = [_threshold_decision(result, phase, dbo_mode, margin) for phase, _ in grids]
    print(f"{model}, {data_parallel_size} ranks, {num_ubatches} ubatches ({ubatch_executor}), {describe_transport(spec, result)}")
    from tandem.bench.tune import tune_document

    config = {**spec.config_dict(), "fabric_model": result.get("fabric")}
    write_thresholds(output, decisions, tune_document(decisions, margin, config))


def _threshold_decision(result: dict, phase: str, dbo_mode: str, margin: float):
    """`tune`'s verdict for one phase: the smallest size from which DBO wins by `margin`."""
    from tandem.bench.report import rows_from_sweep
    from tandem.bench.tune import choose_threshold, paired_ratio

    by_tokens: dict[int, dict[str, float]] = {}
    for r in rows_from_sweep(result, phase, ["none", dbo_mode]):
        by_tokens.setdefault(r["tokens_per_rank"], {})[r["mode"]] = r["step_ms"]
    cells = result["phases"][phase]
    sizes = [(t, v["none"], v[dbo_mode], paired_ratio(cells[t]["none"], cells[t][dbo_mode])) for t, v in by_tokens.items()]
    return choose_threshold(phase, sizes, margin)


# -- tandem profile -------------------------------------------------------------------------


@app.command(short_help="Predict each overlap mode's step on a cluster you don't have (no GPU, no weights).")
def simulate(
    model: str = typer.Option("deepseek-v3", help="A preset (deepseek-v3, tiny-moe, small-moe, ...), a config.json or a model directory."),
    hardware: str = typer.Option(
        "h800",
        help="A hardware profile: h800, h100, h200, b200, a profile .json file, or 'here': this CPU with --ep gloo "
        "ranks, measured now (matmul rates, bandwidth, ubatch hand-over), as tune --simulate here does.",
    ),
    ep: int = typer.Option(32, help="Expert-parallel ranks (DP attention on as many ranks)."),
    phase: str = typer.Option("prefill", help="prefill or decode."),
    tokens_per_rank: int = typer.Option(4096, help="Tokens per rank in the step (decode: requests per rank)."),
    context: int = typer.Option(4096, help="Prompt length (prefill) or cached tokens per request (decode)."),
    draft_tokens: int = typer.Option(0, help="Decode: MTP draft tokens each request verifies per step (DeepSeek's profile: 1)."),
    acceptance: float = typer.Option(0.0, help="Decode: share of the draft tokens kept, for tokens/s (the published figure: 0.6)."),
    modes: str = typer.Option("none,dbo,tbo", help="Comma-separated: none, dbo (2 ubatches), dboN, tbo, sbo-dispatch-shared, "
                              "sbo-combine-shared, sbo-combine-down-gemm (torch_a2a only: --hardware here; DeepEP refuses it)."),
    trace: str = typer.Option(None, help="Write the simulated timelines as Chrome trace JSON to this file."),
    timeline: str = typer.Option(None, help="Draw each mode's timeline to PNG files named after this one (needs matplotlib)."),
    validate: bool = typer.Option(False, help="Also print DeepSeek-V3 on this hardware against DeepSeek's published throughput."),
    link_mbit: float = typer.Option(
        None, help="With --hardware here: the ranks joined by a link shaped to this many Mbit/s (tbf's rate, whole "
        "frames): each transfer's CPU part as measured here, plus its bytes on that link, which overlap can hide.",
    ),
    host_step_ms: float = typer.Option(
        None, help="The engine's CPU work a step outside the forward (scheduling, output processing), in ms: adds each "
        "mode's step under the normal and the overlapped scheduler loop. No default: tandem has no GPU figure.",
    ),
) -> None:
    """One step per rank under each overlap mode: step time, tokens/s/GPU, speed-up over none,
    and the floor max(compute, comm). The layer structure comes from the model config as the
    runtime reads it, the schedules from the runtime's own operation lists and MoE kernel, the
    hardware from a profile of public figures (each cited in its file) or, with --hardware here,
    from this host measured in the same run. See docs/simulate.md."""
    from tandem.simulate import simulate as run
    from tandem.simulate.hardware import HERE

    try:
        if validate and hardware == HERE:
            raise ValueError("--validate compares DeepSeek-V3 with DeepSeek's published H800 throughput, not this "
                             "host; benchmarks/simulate_here.py checks --hardware here against tandem bench")
        sim = run(model, hardware, ep=ep, phase=phase, tokens_per_rank=tokens_per_rank, context=context,
                  modes=[m for m in modes.split(",") if m.strip()], draft_tokens=draft_tokens, acceptance=acceptance,
                  link_mbit=link_mbit, host_step_ms=host_step_ms)
    except (ValueError, OSError) as exc:
        print(f"[tandem] error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(code=2) from None
    print_simulation(sim, validate=hardware if validate else None, trace=trace, timeline=timeline)


@app.command(short_help="Where one prefill and one decode step spend their time, per module, against the roofline.")
@config_command(*ENGINE_SECTIONS)
def profile(
    batch: int = typer.Option(8, help="Requests in the step (the prefill step takes all their prompts at once)."),
    prompt_len: int = typer.Option(128, help="Prompt tokens per request."),
    decode_steps: int = typer.Option(4, help="Decode steps after each prefill (each is one timed decode step)."),
    repeat: int = typer.Option(3, help="Timed rounds (one prefill + --decode-steps decodes each); medians reported."),
    json_path: str = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
    flags: Flags = None,
) -> None:
    """Where one prefill and one decode step spend their time, per module (attention, MoE,
    experts, router, norms, lm_head, plus scheduler, input build, sampler), with device events;
    beside each row its kernels (ATen ops dispatched plus Triton launches, the Triton ones also
    apart and by name), the bytes and FLOPs its shapes imply and its share of the roofline
    measured in the same run; and the step against its weight-bandwidth floor. On CUDA, one
    more step of each phase under torch.profiler lists the GPU kernels by name, count and time.
    One rank, the normal (not overlapped) loop."""
    from tandem.bench.profile_step import format_report, run_profile, write_report

    config = build_config(flags)
    try:
        report = run_profile(config, batch=batch, prompt_len=prompt_len, decode_steps=decode_steps, repeat=repeat)
    except (ValueError, OSError) as exc:
        print(f"[tandem] error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(code=2) from None
    print(format_report(report))
    if json_path:
        print(f"wrote {write_report(json_path, report)}", file=sys.stderr)
