"""`tandem bench` and `tandem tune`: the settings a sweep takes, their options and checks,
the sweep spec they build and how its transport is described."""

from __future__ import annotations

import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import typer

from tandem import tune_sweep
from tandem.cli_config import check_device, torchrun_world


#: The engine settings a sweep takes (the modes it compares set the rest), and how bench and
#: tune differ from the engine commands: two ranks by default, and --fabric also takes
#: 'calibrated'.
BENCH_FLAGS = (
    "model", "data_parallel_size", "num_ubatches", "tbo_token_distribution_threshold", "all2all_backend",
    "moe_backend", "ubatch_split", "fabric", "fabric_latency_us", "fabric_gbps", "device", "dtype",
)
BENCH_DEFAULTS = {"data_parallel_size": 2}
BENCH_HELPS = {
    "model": "What one step runs: a model step of 'tiny-moe' or a Hugging Face directory (ModelRunner.execute, the "
    "serving path), or 'moe-stack' (4 synthetic MoE layers, hidden 1024, top-2 of 8 experts + a shared expert).",
    "data_parallel_size": "Ranks (processes); experts are sharded across them (under torchrun: its WORLD_SIZE).",
    "fabric": "Modelled interconnect: a preset (deepep-ll-h800, deepep-ll-h800-ep64, ...) or 'calibrated' "
    "(bandwidth found so communication ≈ compute at the largest size).",
}
TUNE_SIMULATE = typer.Option(
    None, "--simulate", metavar="HW",
    help="Write the thresholds for a cluster you don't have: the simulator's none / DBO steps on hardware HW (h800, "
    "h100, h200, b200, a profile .json, or 'here': this CPU, measured now) with --data-parallel-size ranks "
    "(DP attention x EP) of --model (a runtime model, deepseek-v3, or a config.json); no rank starts. See docs/simulate.md.",
)
BENCH_REPEAT = typer.Option(5, help="Timed runs per point (median reported); modes are interleaved.")
BENCH_WARMUP = typer.Option(2, help="Untimed runs per point first.")
BENCH_CONTEXT_LEN = typer.Option(tune_sweep.CONTEXT_LEN, help="Decode: cached tokens each request attends over.")
BENCH_PREFILL_LEN = typer.Option(tune_sweep.PREFILL_LEN, help="Prefill: new tokens per request (a batch is several).")


def int_list(text: str, flag: str, *, sort: bool = True) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
        values = sorted(set(values)) if sort else values
    except ValueError:
        raise typer.BadParameter(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise typer.BadParameter(f"{flag} needs token counts >= 1, got {text!r}")
    return values


def bench_spec(*, model, data_parallel_size, grids, modes, repeat, warmup, fabric, fabric_latency_us, fabric_gbps,
                num_ubatches, all2all_backend, moe_backend, context_len, prefill_len, trace=False, device="auto",
                dtype="auto", tbo_token_distribution_threshold=0.48, ubatch_split="tokens", thresholds_file=None):
    from tandem.bench.sweep import CALIBRATED, BenchSpec
    from tandem.bench.workloads import MOE_STACK
    from tandem.platform.device import resolve_device

    check_device(device)
    world = torchrun_world()
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


def run_bench_sweep(spec):
    from tandem.bench import run_sweep
    from tandem.distributed.launch import RankFailedError

    try:
        return run_sweep(spec)
    except RankFailedError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        print(f"[tandem] error: {lines[-1] if lines else exc}", file=sys.stderr, flush=True)
        raise typer.Exit(code=1) from None


def describe_transport(spec, result) -> str:
    fabric = result.get("fabric")
    if fabric is None:
        return "real gloo transport" if spec.data_parallel_size > 1 else "one rank, no all-to-all"
    name = f"--fabric {spec.fabric}: " if spec.fabric else ""
    return f"modelled interconnect ({name}{fabric['latency_us']:.1f} µs + bytes / {fabric['gbps']:.4g} GB/s)"


def simulated_thresholds(model: str, hardware: str, *, ranks: int, num_ubatches: int, grids: dict[str, list[int]],
                         contexts: dict[str, int], margin: float) -> tuple[list, dict]:
    """`tandem tune --simulate`'s verdicts and document (the format `tandem tune` writes), from
    the simulator: `hardware` a profile name or file, or `here`."""
    from tandem.simulate.host import resolve_hardware
    from tandem.simulate.prior import simulated_tune

    return simulated_tune(model, resolve_hardware(hardware, ranks), ranks=ranks, num_ubatches=num_ubatches, grids=grids,
                          contexts=contexts, margin=margin)


def tune_simulated(hardware: str, flags: dict, *, output: str, grids: dict[str, list[int]], margin: float,
                   contexts: dict[str, int]) -> None:
    """`tandem tune --simulate HW`: the thresholds file from the simulator's DBO schedule."""
    ranks, num_ubatches = flags["data_parallel_size"], flags["num_ubatches"]
    try:
        decisions, document = simulated_thresholds(flags["model"], hardware, ranks=ranks, num_ubatches=num_ubatches,
                                                   grids=grids, contexts=contexts, margin=margin)
    except (ValueError, OSError) as exc:
        print(f"[tandem] error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(code=2) from None
    print(f"{flags['model']}, simulated on {document['config']['simulated']['hardware']}: {ranks} ranks "
          f"(DP attention x EP), {num_ubatches} ubatches (the simulator's DBO schedule)")
    write_thresholds(output, decisions, document)


def print_simulation(sim, *, validate: str | None, trace: str | None, timeline: str | None) -> None:
    """`tandem simulate`'s output: the table (with a host figure, the scheduler loops' below it;
    without, one line on stderr saying the loop was not simulated), the validation on the
    `validate` profile, the Chrome trace and the timelines."""
    from tandem.simulate import format_table, format_validation, validation_rows, write_timelines, write_trace
    from tandem.simulate.host_loop import format_loops

    print(format_table(sim))
    if sim.host_step_s is None:
        print(format_loops(sim), file=sys.stderr)
    if validate:
        print("\n" + format_validation(validation_rows(validate)))
    if trace:
        print(f"wrote {write_trace(trace, sim)}", file=sys.stderr)
    if timeline:
        for path in write_timelines(timeline, sim):
            print(f"wrote {path}", file=sys.stderr)


def write_thresholds(output: str, decisions: list, document: dict) -> None:
    """Print `tune`'s verdicts, write its thresholds file and say how to use it."""
    from tandem.bench.tune import NEVER, format_decisions

    simulated = "simulated" in document["config"]
    print(format_decisions(decisions, speedups_from="simulated" if simulated else "median of paired runs"))
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    decode, prefill = document["dbo_decode_token_threshold"], document["dbo_prefill_token_threshold"]
    show = lambda t: "never" if t == NEVER else str(t)  # noqa: E731
    print(f"recommended: --enable-dbo --dbo-decode-token-threshold {decode} "
          f"--dbo-prefill-token-threshold {prefill}  (decode {show(decode)}, prefill {show(prefill)})")
    print(f"or: --thresholds-file {path}")
    print(f"wrote {path}", file=sys.stderr)


@contextmanager
def auto_prior(flags: dict, modes: list[str], phase: str, tokens: list[int], *, context_len: int, prefill_len: int):
    """What `bench`'s auto mode starts from: (the thresholds file, the simulated document or
    None). The --thresholds-file when given; else, for real gloo ranks on this CPU, the
    simulator's prediction for this host (`here`, measured now; `tandem.simulate.serve_prior`,
    as serve and generate take it) in a temporary tune file; else none (a modelled fabric's
    transfers are not this host's to predict)."""
    from tandem.platform.device import resolve_device
    from tandem.simulate.hardware import HERE
    from tandem.simulate.serve_prior import simulate_prior

    check_device(flags["device"])  # a device that is not there is the one error, before anything is measured
    given = flags["thresholds_file"]
    modelled = any(flags[name] is not None for name in ("fabric", "fabric_latency_us", "fabric_gbps"))
    on_cpu = resolve_device(flags["device"]).type == "cpu"
    if "auto" not in modes or given or modelled or not on_cpu or flags["data_parallel_size"] < 2:
        yield given, None
        return
    prior = simulate_prior(
        flags["model"], HERE, ranks=flags["data_parallel_size"], num_ubatches=flags["num_ubatches"],
        grids={"decode": tokens, "prefill": tokens}, contexts={"decode": context_len, "prefill": prefill_len},
        phases=(phase,), margin=tune_sweep.MARGIN,
    )
    print(f"[tandem] {prior.message}", file=sys.stderr)
    if prior.document is None:
        yield None, None
        return
    with tempfile.TemporaryDirectory(prefix="tandem-prior-") as folder:
        path = Path(folder) / "here.json"
        path.write_text(json.dumps(prior.document))
        yield str(path), prior.document
