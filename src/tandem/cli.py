"""The `tandem` command line. Each command is added by the module that implements it."""

from __future__ import annotations

import sys

import typer

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


# Every engine setting is a field of tandem.config's dataclass tree; `config_command` turns the
# sections a command takes into its options (see tandem.cli_options and docs/configuration.md).


def _build_config(flags: Flags, **overrides) -> "EngineConfig":
    """The EngineConfig for a command's flags; a bad value raises `typer.BadParameter`, a
    device this machine lacks exits with one error line."""
    _check_device(flags["device"])
    parallel = {**flags.section_values("parallel"), **overrides.get("parallel", {})}
    if parallel.get("pipeline_parallel_size", 1) > 1:
        try:
            _check_pipeline_partition(flags["model"], parallel["pipeline_parallel_size"], parallel.get("pp_layer_partition"))
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return flags.engine_config(**overrides)


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


def _check_pipeline_partition(model: str, stages: int, partition) -> None:
    """A partition that cannot fit the model fails here, before any rank starts."""
    from tandem.config import parse_int_tuple
    from tandem.distributed import partition_layers
    from tandem.models.loader import num_hidden_layers

    try:
        layers = num_hidden_layers(model)
    except (OSError, KeyError):
        return  # a bad model directory gets its own error where it is loaded
    partition_layers(layers, stages, list(parse_int_tuple(partition)) if partition else None)


def _torchrun_world() -> tuple[int, int] | None:
    from tandem.distributed.torchrun import torchrun_world

    return torchrun_world()


def _torchrun_parallel(flags: Flags) -> dict:
    """Under torchrun the ranks are torchrun's: WORLD_SIZE / PP of them per stage."""
    world = _torchrun_world()
    if world is None:
        return {}
    stages = max(flags["pipeline_parallel_size"], 1)
    if world[1] % stages:
        raise typer.BadParameter(f"torchrun's WORLD_SIZE {world[1]} is not a multiple of --pipeline-parallel-size {stages}")
    return {"data_parallel_size": world[1] // stages}


@app.command()
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

    from tandem.worker.sampling import SamplingParams

    config = _build_config(flags, parallel=_torchrun_parallel(flags))
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, ignore_eos=ignore_eos
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None

    torchrun = _torchrun_world()
    is_head = torchrun is None or torchrun[0] == 0
    log = lambda msg: is_head and print(f"[tandem] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    o, p = config.overlap, config.parallel
    log(
        f"model={config.model} dp={p.data_parallel_size} all2all={p.all2all_backend} moe={p.moe_backend} "
        f"dbo={'on' if o.enable_dbo else 'off'} (ubatches={o.num_ubatches}, executor={o.executor}, "
        f"policy={o.overlap_policy} split={o.ubatch_split} "
        f"thresholds decode={o.dbo_decode_token_threshold} prefill={o.dbo_prefill_token_threshold}) "
        f"sbo={p.sbo_mode if p.enable_sbo else 'off'} graph={o.graph_mode} device={config.device} dtype={config.dtype}"
        + (f" pp={p.pipeline_parallel_size} (depth {p.pp_async_batch_depth})" if p.pipeline_parallel_size > 1 else "")
        + (f" torchrun world={torchrun[1]}" if torchrun else "")
    )
    start = time.perf_counter()
    from tandem.distributed.launch import RankFailedError, launch_ranks
    from tandem.distributed.torchrun import run_torchrun_rank
    from tandem.engine.offline import generate_on_rank

    try:
        if torchrun is not None:
            per_rank = run_torchrun_rank(
                generate_on_rank, config, prompts, params, world_size=p.world_size, device=config.device
            )
        elif p.world_size == 1:
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


@app.command()
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

    flags = flags.replace(model=_one_model(flags["model"], model_option))
    config = _build_config(flags, parallel=_torchrun_parallel(flags))
    http = flags.http_options()
    options = ServeOptions()
    try:
        from tandem.models.loader import load_tokenizer_info

        load_tokenizer_info(config.model)  # a bad model directory fails here, before any rank starts
        if under_torchrun():
            run_torchrun_rank(config, options, http)
        else:
            run_server(config, options, http)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"[tandem] error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(code=1) from None
    except KeyboardInterrupt:
        raise typer.Exit(code=130) from None


def _one_model(positional: str | None, option: str | None) -> str:
    """MODEL or --model (vLLM's two spellings); both given must agree."""
    if positional is not None and option is not None and positional != option:
        raise typer.BadParameter(f"two models given: {positional!r} (argument) and {option!r} (--model); give one")
    from tandem.config import EngineConfig

    return positional or option or EngineConfig.model


# -- tandem bench / tandem tune ------------------------------------------------------------

#: The engine settings a sweep takes (the modes it compares set the rest), and how bench and
#: tune differ from the engine commands: two ranks by default, and --fabric also takes
#: 'calibrated'.
_BENCH_FLAGS = (
    "model", "data_parallel_size", "num_ubatches", "tbo_token_distribution_threshold", "all2all_backend",
    "moe_backend", "ubatch_split", "fabric", "fabric_latency_us", "fabric_gbps", "device", "dtype",
)
_BENCH_DEFAULTS = {"data_parallel_size": 2}
_BENCH_HELPS = {
    "model": "What one step runs: a model step of 'tiny-moe' or a Hugging Face directory (ModelRunner.execute, the "
    "serving path), or 'moe-stack' (4 synthetic MoE layers, hidden 1024, top-2 of 8 experts + a shared expert).",
    "data_parallel_size": "Ranks (processes); experts are sharded across them (under torchrun: its WORLD_SIZE).",
    "fabric": "Modelled interconnect: a preset (deepep-ll-h800, deepep-ll-h800-ep64, ...) or 'calibrated' "
    "(bandwidth found so communication ≈ compute at the largest size).",
}
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
    world = _torchrun_world()
    if world is not None:
        data_parallel_size = world[1]  # torchrun decides the ranks
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
        from tandem.config import EngineConfig, OverlapConfig, ParallelConfig

        try:
            overlap = OverlapConfig(
                num_ubatches=num_ubatches, dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0,
                tbo_token_distribution_threshold=tbo_token_distribution_threshold, ubatch_split=ubatch_split,
            )
            engine = EngineConfig(
                model=model,
                overlap=overlap.with_thresholds_file(thresholds_file),
                parallel=ParallelConfig(
                    data_parallel_size=data_parallel_size, all2all_backend=all2all_backend, moe_backend=moe_backend
                ),
                device=device,
                dtype=dtype,
            )
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return BenchSpec(
        model=model, data_parallel_size=data_parallel_size, grids=grids, modes=modes, repeat=repeat, warmup=warmup,
        fabric=fabric, fabric_latency_us=fabric_latency_us, fabric_gbps=fabric_gbps, num_ubatches=num_ubatches,
        all2all_backend=all2all_backend, context_len=context_len, prefill_len=prefill_len, engine_config=engine,
        trace=trace, device=device, dtype=dtype, ubatch_split=ubatch_split, thresholds_file=thresholds_file,
    )


def _run_bench_sweep(spec):
    from tandem.bench import run_sweep
    from tandem.distributed.launch import RankFailedError

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
@config_command(*ENGINE_SECTIONS, only=(*_BENCH_FLAGS, "thresholds_file", "trace"), defaults=_BENCH_DEFAULTS, helps=_BENCH_HELPS)
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
    repeat: int = _BENCH_REPEAT,
    warmup: int = _BENCH_WARMUP,
    context_len: int = _BENCH_CONTEXT_LEN,
    prefill_len: int = _BENCH_PREFILL_LEN,
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
    trace = flags["trace"]
    spec = _bench_spec(
        **{name: flags[name] for name in _BENCH_FLAGS}, thresholds_file=flags["thresholds_file"],
        grids=[(phase, _int_list(tokens, "--tokens"))], modes=mode_list, repeat=repeat, warmup=warmup,
        context_len=context_len, prefill_len=prefill_len, trace=trace is not None or timeline is not None,
    )
    result = _run_bench_sweep(spec)
    if result is None:
        return  # a torchrun rank other than 0
    model, data_parallel_size, num_ubatches = spec.model, spec.data_parallel_size, spec.num_ubatches
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
@config_command(
    *ENGINE_SECTIONS, only=(*_BENCH_FLAGS, "ubatch_executor", "enable_two_batch_overlap"),
    defaults=_BENCH_DEFAULTS, helps=_BENCH_HELPS,
)
def tune(
    output: str = typer.Option("dbo_thresholds.json", help="Thresholds file for serve/generate --thresholds-file."),
    margin: float = typer.Option(0.03, help="DBO must be at least this much faster (0.03 = 3%)."),
    decode_tokens: str = typer.Option("8,16,32,64,128,256", help="Decode batch sizes (tokens per rank) to sweep."),
    prefill_tokens: str = typer.Option("64,128,256,512,1024,2048", help="Prefill sizes (tokens per rank) to sweep."),
    repeat: int = _BENCH_REPEAT,
    warmup: int = _BENCH_WARMUP,
    context_len: int = _BENCH_CONTEXT_LEN,
    prefill_len: int = _BENCH_PREFILL_LEN,
    flags: Flags = None,
) -> None:
    """Sweep decode and prefill steps with and without DBO, pick for each phase the smallest
    token count from which DBO beats no overlap by --margin at every larger size tried, and
    write the thresholds (JSON with dbo_decode_token_threshold and dbo_prefill_token_threshold).
    Under torchrun each process is one rank and rank 0 writes the file."""
    import json
    from pathlib import Path

    from tandem.bench.report import rows_from_sweep
    from tandem.bench.tune import NEVER, choose_threshold, format_decisions, paired_ratio

    if not 0 <= margin < 1:
        raise typer.BadParameter(f"--margin must be in [0, 1), got {margin}")
    ubatch_executor = "stages" if flags["enable_two_batch_overlap"] else flags["ubatch_executor"]
    modes_of = {"thread": "dbo", "greenlet": "dbo-greenlet", "stages": "tbo"}
    if ubatch_executor not in modes_of:
        raise typer.BadParameter(f"--ubatch-executor must be one of {', '.join(modes_of)}")
    dbo_mode = modes_of[ubatch_executor]
    grids = [("decode", _int_list(decode_tokens, "--decode-tokens")), ("prefill", _int_list(prefill_tokens, "--prefill-tokens"))]
    spec = _bench_spec(
        **{name: flags[name] for name in _BENCH_FLAGS}, grids=grids, modes=["none", dbo_mode], repeat=repeat,
        warmup=warmup, context_len=context_len, prefill_len=prefill_len,
    )
    result = _run_bench_sweep(spec)
    if result is None:
        return  # a torchrun rank other than 0
    model, data_parallel_size, num_ubatches = spec.model, spec.data_parallel_size, spec.num_ubatches
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


# -- tandem profile -------------------------------------------------------------------------


@app.command()
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
    beside each row its kernels (ATen ops dispatched), the bytes and FLOPs its shapes imply and
    its share of the roofline measured in the same run; and the step against its
    weight-bandwidth floor. One rank, the normal (not overlapped) loop."""
    from tandem.bench.profile_step import format_report, run_profile, write_report

    config = _build_config(flags)
    try:
        report = run_profile(config, batch=batch, prompt_len=prompt_len, decode_steps=decode_steps, repeat=repeat)
    except (ValueError, OSError) as exc:
        print(f"[tandem] error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(code=2) from None
    print(format_report(report))
    if json_path:
        print(f"wrote {write_report(json_path, report)}", file=sys.stderr)
