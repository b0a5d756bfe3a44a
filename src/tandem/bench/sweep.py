"""The sweep: on every rank, for each phase and token count, run every mode (and the floor)
`warmup + repeat` times, modes interleaved so they all see the same machine state."""

from __future__ import annotations

import statistics
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tandem.bench.workloads import MOE_STACK, MoEStackWorkload, ModelStepWorkload, Sample
from tandem.contexts.trace import Tracer, gather_trace
from tandem.modular_kernels import FabricModel

#: Per-transfer latency of the calibrated fabric; small, so transfers are bandwidth-bound
#: and a ubatch's transfer shrinks with its size, as on a real fabric at these sizes.
CALIBRATED_LATENCY_US = 50.0
CALIBRATED = "calibrated"


@dataclass
class BenchSpec:
    model: str = "tiny-moe"
    data_parallel_size: int = 2
    #: (phase, token counts per rank) in the order they run.
    grids: list[tuple[str, list[int]]] = field(default_factory=lambda: [("decode", [32, 128, 512])])
    modes: list[str] = field(default_factory=lambda: ["none", "dbo"])
    repeat: int = 5
    warmup: int = 2
    #: A preset name, "calibrated" (comm ≈ compute at the first grid's largest size), or None.
    fabric: str | None = None
    fabric_latency_us: float | None = None
    fabric_gbps: float | None = None
    num_ubatches: int = 2
    all2all_backend: str | None = None
    context_len: int = 128
    prefill_len: int = 512
    #: Record the overlap timeline of every step (`--trace` / `--timeline`): the result
    #: then holds the ranks' merged Chrome trace under "trace".
    trace: bool = False
    ubatch_split: str = "tokens"
    #: A `tandem tune` file: the `auto` mode's prior (and static thresholds).
    thresholds_file: str | None = None
    #: The EngineConfig for model-step workloads (built by the CLI from the shared flags).
    engine_config: Any = None
    device: str = "auto"
    dtype: str = "auto"

    def config_dict(self) -> dict:
        d = asdict(self)
        d.pop("engine_config")
        d["grids"] = [{"phase": p, "tokens_per_rank": list(t)} for p, t in self.grids]
        return d


def _workload(spec: BenchSpec, rank: int, world: int, phase: str, max_tokens: int):
    if spec.model == MOE_STACK:
        return MoEStackWorkload(
            rank, world, backend=spec.all2all_backend or "torch_a2a", num_ubatches=spec.num_ubatches, phase=phase,
            thresholds_file=spec.thresholds_file,
        )
    return ModelStepWorkload(
        spec.engine_config, phase=phase, context_len=spec.context_len, prefill_len=spec.prefill_len,
        max_tokens=max_tokens, distributed=world > 1,
    )


def calibrate_fabric(workload, tokens: int, latency_us: float = CALIBRATED_LATENCY_US) -> FabricModel:
    """A bandwidth-bound fabric on which communication takes about as long as compute at
    `tokens`: communication is `a + b / bandwidth`, solved from two measurements and refined
    by secant steps. Every rank computes the same answer (the times are the slowest
    rank's, or gathered)."""

    def measure(fabric: FabricModel | None) -> tuple[float, float]:
        workload.set_fabric(fabric)
        runs = [workload.floor(tokens) for _ in range(3)]
        return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)

    measure(None)  # warm-up
    compute_s, base_comm_s = measure(None)
    latency_s = latency_us * 1e-6
    fixed_s = base_comm_s + 2 * workload.num_moe_layers * latency_s
    if compute_s <= fixed_s * 1.05:
        return FabricModel(latency_s, float("inf"))  # communication already ≥ compute
    # First guess: the bytes of a step are unknown, so probe with one bandwidth and solve.
    inv_bw = 1 / 1e9
    for _ in range(4):
        fabric = FabricModel(latency_s, 1 / inv_bw)
        compute_s, comm_s = measure(fabric)
        variable = comm_s - fixed_s
        if variable <= 0:
            inv_bw *= 10
            continue
        inv_bw *= max(compute_s - fixed_s, 1e-6) / variable
    workload.set_fabric(None)
    return FabricModel(latency_s, 1 / inv_bw)


def _fabric(spec: BenchSpec, workload, tokens: int) -> FabricModel | None:
    if spec.fabric == CALIBRATED:
        if spec.fabric_latency_us is not None or spec.fabric_gbps is not None:
            raise ValueError("--fabric calibrated finds its own bandwidth; drop --fabric-latency-us / --fabric-gbps")
        return calibrate_fabric(workload, tokens)
    return FabricModel.from_flags(spec.fabric_latency_us, spec.fabric_gbps, spec.fabric)


def _record(sample: Sample) -> dict:
    t = sample.mean_times
    return {
        "step_s": sample.step_s,
        "compute_s": t.compute_s,
        "recv_wait_s": t.recv_wait_s,
        "comm_s": t.comm_s,
        "switch_s": t.switch_s,
    }


def sweep_on_rank(rank: int, world: int, spec: BenchSpec, progress=None) -> dict:
    """Run the sweep on this rank; every rank returns the same (gathered) results."""
    torch.set_num_threads(1)
    fabric = None
    tracer = Tracer(rank) if spec.trace else None
    out: dict = {"phases": {}, "fabric": None}
    for index, (phase, grid) in enumerate(spec.grids):
        workload = _workload(spec, rank, world, phase, max(grid))
        if index == 0:
            fabric = _fabric(spec, workload, max(grid))
            out["fabric"] = None if fabric is None else {"latency_us": fabric.latency_us, "gbps": fabric.gbps}
        workload.set_fabric(fabric)
        workload.set_tracer(tracer)  # after the calibration: its steps are not part of the sweep
        results: dict = {}
        for tokens in grid:
            cell = {mode: [] for mode in spec.modes}
            cell["_floor"] = []
            for i in range(spec.warmup + spec.repeat):
                none_sample = None
                for mode in spec.modes:
                    sample = workload.measure(mode, tokens)
                    if mode == "none":
                        none_sample = sample
                    if i >= spec.warmup:
                        cell[mode].append(_record(sample))
                compute_s, comm_s = workload.floor(tokens, none_sample)
                if i >= spec.warmup:
                    cell["_floor"].append({"compute_s": compute_s, "comm_s": comm_s})
                if progress is not None and rank == 0:
                    progress.put(1)
            results[tokens] = cell
        out["phases"][phase] = results
        del workload
    if tracer is not None:
        out["trace"] = gather_trace(tracer, dist.group.WORLD if world > 1 else None)
    return out


def _drain_progress(queue, bar, stop: threading.Event) -> None:
    import queue as queue_mod

    while not stop.is_set():
        try:
            bar.update(queue.get(timeout=0.2))
        except (queue_mod.Empty, EOFError, OSError):
            continue


def run_sweep(spec: BenchSpec, *, show_progress: bool = True, timeout_s: float = 3600.0) -> dict:
    """Launch `spec.data_parallel_size` ranks, run the sweep with a progress bar on stderr,
    return rank 0's results. Under torchrun this process is one rank: rank 0 returns the
    results, the others None."""
    import sys

    import torch.multiprocessing as mp
    from tqdm import tqdm

    from tandem.distributed.launch import launch_ranks
    from tandem.distributed.torchrun import run_torchrun_rank, under_torchrun

    if under_torchrun():
        # One rank of torchrun's world; rank 0 gets the results (every rank's are the same).
        per_rank = run_torchrun_rank(
            sweep_on_rank, spec, world_size=spec.data_parallel_size, device=spec.device, timeout_s=timeout_s
        )
        return None if per_rank is None else per_rank[0]
    total = sum(len(grid) for _, grid in spec.grids) * (spec.warmup + spec.repeat)
    queue = mp.get_context("spawn").Queue()
    stop = threading.Event()
    bar = tqdm(total=total, desc="bench", unit="round", file=sys.stderr, disable=not show_progress, leave=False)
    reader = threading.Thread(target=_drain_progress, args=(queue, bar, stop), daemon=True)
    reader.start()
    try:
        return launch_ranks(sweep_on_rank, spec.data_parallel_size, spec, queue, timeout_s=timeout_s, device=spec.device)[0]
    finally:
        stop.set()
        reader.join(timeout=2)
        bar.close()


__all__ = ["BenchSpec", "CALIBRATED", "calibrate_fabric", "run_sweep", "sweep_on_rank"]
