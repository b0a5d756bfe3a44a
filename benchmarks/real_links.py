"""Every overlap mode on real transfers: 2 hosts in network namespaces, a `tbf`-shaped link.

One run: `moe-stack` (the MoE layer stack of `tandem bench`) and `small-moe` (a model step
of the built-in preset), decode and prefill, modes none / dbo / dbo-greenlet / tbo / the three
SBO modes / auto, at three link rates chosen so that communication takes about 0.5x, 1x and
2x the computation. Everything is measured in the same run:

- compute = the step of mode `none` on the unshaped link (median of the repeats, taken
  right before each rate's row);
- comm at a rate = the `none` step on the shaped link minus compute;
- floor = max(compute, comm): what a perfect overlap would reach.

The rates come from a calibration at the start of each (workload, phase): the `none` step at
two probe rates fits comm(rate) = k * rate^-alpha (log-log: a tbf link is not linear in
1/rate), solved for the three targets.

The ranks are torchrun nodes, one per namespace host (`GLOO_SOCKET_IFNAME` = its veth), each
running this file's `--worker` entry point with the bench workloads of `tandem.bench`. Rank 0
asks the driver (this process, outside the namespaces) to change the link rate through files
in a control directory, so one torchrun job covers the whole run and the model is built once.

Each row is also predicted (#31): `tandem simulate --hardware here` measured in the same run,
before the ranks start (gloo over loopback, outside the namespaces), with the transfers' CPU part
taken from each job's own dispatch and combine line over the unshaped veth, and each rate's wire
part from that job's probes (`tandem.simulate.shaped_link.ShapedLink.calibrated`: the none step's
comm over the bytes the simulated step sends at the two calibration probes and at each row's own
rate just before the row, joined in log-log). Per row: measured against predicted, the error, the sign of (mode - none) both ways,
and the simulated terms between the step and its floor (switch cost, split loss, transfer CPU or
exposed wire; the ranks' imbalance is not modelled); beside it the overlap model alone (every CPU
cost scaled to the row's measured compute; `real_links_predict.py`). `auto`, which picks a mode
per step, is listed, not predicted.

`auto` (the planner over none and DBO on threads, `tandem.bench.modes`) starts each row from the
simulator's prior: the none and DBO steps that row predicts, as a `tandem tune` document made on
rank 0 once the job's probes are in and broadcast to the other rank (both planners must predict
alike: their choices are agreed from their predictions), a fresh planner per row. Each row keeps
the prior and the choice auto ran at every step; the goals put auto against the best static
mode and the best of none and dbo, and say where the repeats do not resolve 1.03x.

    sudo python benchmarks/real_links.py            # full run (~7 min on 2 cores, 5 repeats a row)
    python benchmarks/real_links.py --predict benchmarks/results/real_links.json   # predict a saved run again
    sudo python benchmarks/real_links.py --quick    # smoke run: small shapes, one rate

Prints one table per (workload, phase) and writes benchmarks/results/real_links.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # this checkout's tandem, not an installed one

from real_links_predict import auto_prior, format_predictions, kept_under_transfer, measure_host, predict  # noqa: E402 - after the path

MODES = ["none", "dbo", "dbo-greenlet", "tbo", "sbo-combine-down-gemm", "sbo-combine-shared", "sbo-dispatch-shared", "auto"]
#: comm / compute targets of the three link rates.
TARGET_RATIOS = (0.5, 1.0, 2.0)
RESULT = HERE / "results" / "real_links.json"
#: The host profile the driver hands the ranks, in the control directory.
HOST_PROFILE_FILE = "host_profile.json"
#: Every wait for the other side of the control channel is bounded.
CONTROL_TIMEOUT_S = 300.0


def full_plan() -> dict:
    return {
        "jobs": [
            # The goals' rows first: a run cut short by its timeout keeps them.
            {"workload": "moe-stack", "phase": "prefill", "tokens": 512},
            {"workload": "moe-stack", "phase": "decode", "tokens": 64},
            {"workload": "small-moe", "phase": "decode", "tokens": 64},
            {"workload": "small-moe", "phase": "prefill", "tokens": 512},
        ],
        "modes": MODES,
        "ratios": list(TARGET_RATIOS),
        #: Rounds per row not kept: the auto planner's first step (decided by its prior alone) is one.
        "warmup": 1,
        "repeat": 5,
        "compute_repeat": 5,
        #: none steps that probe the link at each row's rate before the row.
        "link_repeat": 3,
        "probe_mbit": 400.0,
        #: The rate compute under a transfer is measured at, once for the run.
        "under_transfer_mbit": 400.0,
        "context_len": 256,
        "threads": 1,
    }


def quick_plan() -> dict:
    plan = full_plan()
    plan.update(
        # The stack's own shape: the simulator predicts tandem bench's moe-stack.
        jobs=[{"workload": "moe-stack", "phase": "prefill", "tokens": 64}],
        # auto: its prior is simulated and handed from rank 0 (the path a full run takes).
        modes=["none", "dbo", "auto"],
        ratios=[1.0],
        warmup=1,
        repeat=2,
        compute_repeat=2,
        link_repeat=1,
        one_host=False,
    )
    return plan


# --------------------------------------------------------------------------- control channel


class Control:
    """Rank 0 ↔ driver over files in a shared directory (the namespaces share the file
    system, not the network): rank 0 writes `req-N.json`, the driver acts and writes `ack-N`."""

    def __init__(self, directory: str):
        self.dir = Path(directory)
        self.count = 0

    def request(self, **payload) -> None:
        n, self.count = self.count, self.count + 1
        tmp = self.dir / f"req-{n}.json.tmp"
        tmp.write_text(json.dumps(payload))
        tmp.rename(self.dir / f"req-{n}.json")
        ack = self.dir / f"ack-{n}"
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        while not ack.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the driver did not answer request {n} ({payload}) within {CONTROL_TIMEOUT_S:.0f} s")
            time.sleep(0.01)

    def serve_one(self, act) -> bool:
        """Answer the next request if there is one; False when none is waiting."""
        req = self.dir / f"req-{self.count}.json"
        if not req.exists():
            return False
        act(json.loads(req.read_text()))
        (self.dir / f"ack-{self.count}").write_text("ok")
        self.count += 1
        return True


# --------------------------------------------------------------------------- worker (one rank)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _workload(job: dict, plan: dict, rank: int, world: int):
    from tandem.bench.workloads import MoEStackWorkload, ModelStepWorkload

    if job["workload"] == "moe-stack":
        return MoEStackWorkload(rank, world, backend="torch_a2a", num_ubatches=2, phase=job["phase"], **job.get("shape", {}))
    from tandem.config import CacheConfig, EngineConfig, ParallelConfig

    config = EngineConfig(
        model=job["workload"],
        parallel=ParallelConfig(data_parallel_size=world, all2all_backend="torch_a2a" if world > 1 else None),
        cache=CacheConfig(),
        device="cpu",
        dtype="float32",
    )
    return ModelStepWorkload(
        config, phase=job["phase"], context_len=plan["context_len"], prefill_len=job["tokens"],
        max_tokens=job["tokens"], distributed=world > 1,
    )


def _steps(workload, mode: str, tokens: int, n: int) -> list[float]:
    return [workload.measure(mode, tokens).step_s for _ in range(n)]


def _compute_alone(workload, tokens: int, n: int) -> float | None:
    """The step's computation with no transfer (the MoE stack's floor part `compute`: experts
    local, no all-to-all), median of `n`; None for a model step, which has no such mode. Beside
    the unshaped none step it splits that step into compute and the transfers' CPU, so a
    prediction that misses says which of the two it missed."""
    if getattr(workload, "stack", None) is None:
        return None
    _steps(workload, "compute", tokens, 1)  # its first step builds the local kernels
    return _median(_steps(workload, "compute", tokens, n))


def _none_comm(workload, tokens: int, n: int, compute_s: float) -> float:
    """Communication of the none step as the table defines it (shaped step minus the
    unshaped one, measured just before); where load noise makes that non-positive, the
    step's own time model (its receive waits, mean over ranks)."""
    samples = [workload.measure("none", tokens) for _ in range(n)]
    by_step = _median([s.step_s for s in samples]) - compute_s
    return by_step if by_step > 0 else _median([s.mean_times.recv_wait_s for s in samples])


def _outputs_digest(workload, tokens: int) -> dict:
    """Outputs of none and dbo on the same input (moe-stack only: its forward returns them):
    the smoke test checks DBO changes nothing."""
    from tandem.bench.workloads import MoEStack

    stack: MoEStack = getattr(workload, "stack", None)
    if stack is None:
        return {}
    from tandem.contexts import run_ubatches

    x = stack.inputs(tokens)
    kernels = [stack._kernel(layer, comm=True, sbo=None, fabric=None, max_tokens=tokens) for layer in stack.layers]
    plain = stack._forward(x, kernels, compute=True, local_ids=False)
    halves = run_ubatches(
        [lambda c=c: stack._forward(c, kernels, compute=True, local_ids=False) for c in x.tensor_split(2)],
        executor=stack.executors["thread"],
    )
    import torch

    split = torch.cat(halves)
    return {"none_sum": float(plain.sum()), "dbo_sum": float(split.sum()), "max_abs_diff": float((plain - split).abs().max())}


def _start_auto_from_prior(workload, job: dict, plan: dict, host: dict, rate: float) -> dict | None:
    """A fresh overlap planner for the row at `rate`, starting from the simulator's prior there
    (`real_links_predict.auto_prior`: none and DBO on the profile and link the row's predictions
    use). Made on rank 0 and handed to the other rank (`agreed_document`): the job record it
    is made from holds rank 0's own veth line and compute-under-transfer, which the other rank
    measured differently, and both planners must predict alike, since their choices are agreed
    from their predictions. A new document is a new planner (`PlannerCache` keys it by
    identity): what auto learnt at one rate does not carry to the next."""
    from tandem.simulate.prior import agreed_document

    document = agreed_document(lambda: auto_prior(job, plan, host, rate))
    workload.base_overlap = dataclasses.replace(workload.base_overlap, simulated_prior=document)
    return document


def _auto_planner(workload):
    """The planner the auto mode runs: the model runner's under the settings of its last step
    (call it after an auto step), or the MoE stack's for the auto settings (`PlannerCache`
    gives the same settings the same planner)."""
    from tandem.bench.modes import mode_overlap

    runner = getattr(workload, "runner", None)
    if runner is not None:
        return runner.planner
    return workload.stack.planners.planner(mode_overlap(workload.base_overlap, "auto"), sbo=False)


def _measure_row(workload, modes: list[str], tokens: int, plan: dict) -> dict:
    """Every mode at the current rate: `plan['warmup']` rounds then `plan['repeat']` kept, the
    modes interleaved so that every mode sees the same machine state; which choice the auto
    planner ran at each step (its `PlannerStats.choices`, read after the step), warm-up first."""
    samples: dict[str, list[float]] = {m: [] for m in modes}
    waits: dict[str, list[float]] = {m: [] for m in modes}
    choices: list[str] = []
    seen: dict[str, int] = {}
    for i in range(plan["warmup"] + plan["repeat"]):
        for mode in modes:
            sample = workload.measure(mode, tokens)
            if mode == "auto":
                counts = dict(_auto_planner(workload).stats.choices)
                choices += [name for name, n in counts.items() if n > seen.get(name, 0)]
                seen = counts
            if i >= plan["warmup"]:
                samples[mode].append(sample.step_s)
                waits[mode].append(sample.mean_times.recv_wait_s)
    out = {"samples_s": samples, "recv_wait_s": {m: _median(v) for m, v in waits.items()}}
    if "auto" in modes:
        out["auto_choices"] = {"warmup": choices[: plan["warmup"]], "measured": choices[plan["warmup"]:]}
    return out


def run_job(job: dict, plan: dict, host: dict, control: Control | None, rank: int, world: int, log,
            under_transfer: dict | None = None) -> dict:
    """One (workload, phase): its compute, transfer line and probes, then every row; the
    run's compute-under-transfer measurement (`_compute_under_transfer`) is kept with the job,
    which its predictions read."""
    import torch.distributed as dist

    def set_rate(mbit: float | None) -> None:
        if control is not None:
            control.request(rate_mbit=mbit)
        dist.barrier()

    tokens, modes = job["tokens"], plan["modes"]
    start = time.perf_counter()
    workload = _workload(job, plan, rank, world)
    log(f"{job['workload']} {job['phase']} {tokens} tok/rank: built in {time.perf_counter() - start:.1f} s")

    set_rate(None)
    _steps(workload, "none", tokens, plan["warmup"] + 1)
    compute_s = unshaped_none_s = _median(_steps(workload, "none", tokens, plan["compute_repeat"]))
    log(f"  compute (unshaped none step) {compute_s * 1e3:.1f} ms")
    alone_s = _compute_alone(workload, tokens, plan["compute_repeat"])
    if alone_s is not None:
        log(f"  compute alone (experts local, no transfer) {alone_s * 1e3:.1f} ms: the transfers over the unshaped "
            f"veth and the step's agreement are {(compute_s - alone_s) * 1e3:.1f} ms of the none step")
    veth_line, veth_sync_wait = _veth_line(rank, world, log)

    # Calibration: the none step at two probe rates. A probe that leaves comm tiny next to
    # compute measures mostly noise: lower it.
    probe = plan["probe_mbit"]
    for _ in range(3):
        set_rate(probe)
        probe_comm = _none_comm(workload, tokens, 2, compute_s)
        if probe_comm >= 0.3 * compute_s:
            break
        probe = probe * max(probe_comm, 0.05 * compute_s) / compute_s
    probe_comm = max(probe_comm, 1e-4)
    set_rate(probe / 2)
    half_comm = max(_none_comm(workload, tokens, 2, compute_s), probe_comm * 1.05)
    # comm = k * rate^-alpha through the two probes: a shaped link is not linear in 1/rate
    # (tbf's queue shrinks with the rate, TCP backs off), so interpolate in log-log.
    # Bounded: a noisy probe pair must not send a row to a rate where one step takes minutes.
    alpha = min(max(math.log2(half_comm / probe_comm), 0.8), 2.0)
    rates = [
        min(max(probe * (probe_comm / (ratio * compute_s)) ** (1 / alpha), probe / 8), probe * 8) for ratio in plan["ratios"]
    ]
    log(
        f"  probes {probe:.0f} / {probe / 2:.0f} Mbit/s → comm {probe_comm * 1e3:.1f} / {half_comm * 1e3:.1f} ms "
        f"(comm ~ rate^-{alpha:.2f}); rates " + ", ".join(f"{r:.0f}" for r in rates)
    )

    # What the row predictions calibrate from (`predict_job`); each row adds its own link probe.
    calibrated = {**job, "probe_mbit": probe, "probe_comm_s": probe_comm, "fit_alpha": alpha,
                  "veth_line_points": veth_line, "veth_sync_wait_s": veth_sync_wait, "compute_under_transfer": under_transfer,
                  "unshaped_none_s": unshaped_none_s, "compute_alone_s": alone_s,
                  "half_probe_comm_s": half_comm, "rate_probes": []}
    rows = []
    for ratio, rate in zip(plan["ratios"], rates):
        # The machine's load drifts: compute is re-measured (unshaped) right before each row.
        set_rate(None)
        compute_s = _median(_steps(workload, "none", tokens, plan["compute_repeat"]))
        set_rate(rate)
        # The link at the row's own rate, for the predictions and the auto prior: two probes
        # extrapolated to rates 7x apart missed the rows' comm by -26 to +33 %.
        calibrated["rate_probes"].append([rate, max(_none_comm(workload, tokens, plan.get("link_repeat", 3), compute_s), 1e-4)])
        prior = _start_auto_from_prior(workload, calibrated, plan, host, rate) if "auto" in modes else None
        measured = _measure_row(workload, modes, tokens, plan)
        samples = measured.pop("samples_s")
        medians = {m: _median(v) for m, v in samples.items()}
        comm_s = max(medians["none"] - compute_s, 0.0)
        floor_s = max(compute_s, comm_s)
        rows.append(
            {
                "target_ratio": ratio,
                "rate_mbit": rate,
                "compute_s": compute_s,
                "comm_s": comm_s,
                "comm_over_compute": comm_s / compute_s,
                "floor_s": floor_s,
                "step_s": medians,
                "samples_s": samples,
                # recv_wait_s: the time model's exposed communication (receive waits), mean over ranks.
                **measured,
                "vs_none": {m: medians["none"] / v for m, v in medians.items()},
                "vs_floor": {m: v / floor_s for m, v in medians.items()},
                **({"auto_prior": prior} if "auto" in modes else {}),
            }
        )
        log(f"  {rate:.0f} Mbit/s: comm/compute {comm_s / compute_s:.2f}; " + ", ".join(f"{m} {v * 1e3:.0f}" for m, v in medians.items())
            + (f"; auto {_describe_auto(rows[-1])}" if "auto" in modes else ""))
    set_rate(None)
    digest = _outputs_digest(workload, tokens)
    del workload
    return {**calibrated, "rows": rows, "outputs": digest}


def _compute_under_transfer(rate_mbit: float, log, repeat: int = 5) -> dict:
    """At the current shaped rate: a fixed matmul loop timed alone and while an all-to-all is on
    the wire (issued just before it, sized to outlast it), on both ranks at once as a DBO step
    runs them, the two interleaved, `repeat` each. Their means' ratio is the rate compute keeps
    while a shaped transfer is in flight: the CPU the transfer takes from the cores as its
    packets trickle through (a transfer merely pending costs none: gloo does not spin). The same
    all-to-all timed alone, against its time beside the loop, gives the share of its pace the
    wire keeps while compute runs."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    a, b = torch.randn(64, 1024), torch.randn(1024, 1024)

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(40):
            a @ b
        return time.perf_counter() - start

    loop()
    slowest = torch.tensor([_median([loop() for _ in range(3)])], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # both ranks size the same transfer
    alone_s = float(slowest)
    # The wire at 2x the loop's time alone, at the nominal rate: the loop runs under it throughout.
    rows = max(world, int(2.0 * alone_s * rate_mbit * 1e6 / 8 / 4096 * world / (world - 1)))
    payload, out = torch.randn(rows, 1024), torch.empty(rows, 1024)
    alone, busy, overlapped, beside = [], [], [], []
    for _ in range(repeat):
        dist.barrier()
        alone.append(loop())
        dist.barrier()
        start = time.perf_counter()
        work = dist.all_to_all_single(out, payload, async_op=True)
        busy.append(loop())
        overlapped.append(not work.is_completed())
        work.wait()
        beside.append(time.perf_counter() - start)
    wire = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        dist.all_to_all_single(out, payload)
        wire.append(time.perf_counter() - start)
    rate, resolved = kept_under_transfer(alone, busy)
    log(f"  compute under a transfer at {rate_mbit:.0f} Mbit/s: {statistics.mean(busy) * 1e3:.1f} ms against "
        f"{statistics.mean(alone) * 1e3:.1f} ms alone (means; rate {rate:.2f}{'' if resolved else ', not resolved'}; "
        f"the wire outlasted the loop {sum(overlapped)} of {repeat})")
    # The transfer ran beside the loop for the loop's time, then alone: what it did not move
    # while the loop ran is the share of its pace compute took from it.
    kept = (_median(wire) - (_median(beside) - _median(busy))) / _median(busy)
    wire_rate = min(max(kept, 0.05), 1.0)
    verdict = (f"the wire kept {wire_rate:.2f} of its pace while compute ran" if kept <= 1.0 else
               f"not resolved: beside the loop it went faster than alone ({kept:.2f}), priced as 1.00")
    log(f"  the transfer beside the loop: {_median(beside) * 1e3:.1f} ms against {_median(wire) * 1e3:.1f} ms alone ({verdict})")
    return {"rate_mbit": rate_mbit, "alone_s": alone, "under_transfer_s": busy, "outlasted": overlapped, "rate": rate,
            "wire_s": wire, "beside_loop_s": beside, "wire_rate": wire_rate}


def _run_compute_under_transfer(plan: dict, control: Control | None, log) -> dict:
    """`_compute_under_transfer` once for the whole run, at the plan's `under_transfer_mbit`: what a
    transfer's packets take from compute is the host's, not a job's, and a rate where the loss
    is well above the noise measures it best (a job's low probe rate left it at 1.00, no loss,
    where the same run measured 0.47-0.58 at 200 Mbit/s)."""
    import torch.distributed as dist

    rate = plan.get("under_transfer_mbit", 400.0)  # a plan written before the key: the full plan's rate
    log(f"compute under a transfer, once for the run at {rate:.0f} Mbit/s")
    if control is not None:
        control.request(rate_mbit=rate)
    dist.barrier()
    try:
        return _compute_under_transfer(rate, log)
    finally:
        if control is not None:
            control.request(rate_mbit=None)
        dist.barrier()


def _veth_line(rank: int, world: int, log) -> tuple[dict, float]:
    """The transfers' CPU part on this path: `tandem.simulate.host_link`'s dispatch and combine
    calls between the two namespace hosts over the unshaped veth (no tbf: nothing waits on a
    rate), (bytes per rank, seconds) on rank 0, whose line is what a transfer costs the cores;
    and the ranks' skew at those calls (`host_link.sync_wait`)."""
    from tandem.simulate.host_link import TOKENS, rank_calls

    points, waited = rank_calls(rank, world, TOKENS, repeat=7, warmup=2)
    log("  gloo over the unshaped veth: " + "; ".join(
        f"{kind} " + ", ".join(f"{b / 1e6:.2f} MB {t * 1e3:.2f} ms" for b, t in pts) for kind, pts in points.items())
        + f"; the last rank comes {waited * 1e3:.2f} ms after the ranks' mean")
    return points, waited


def worker_main(args) -> None:
    import torch
    import torch.distributed as dist

    from tandem.distributed.launch import init_rank

    plan = json.loads(Path(args.plan).read_text())
    torch.set_num_threads(plan["threads"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_rank(rank, world, device="cpu", timeout_s=CONTROL_TIMEOUT_S)
    control = Control(args.control) if rank == 0 else None
    # The driver's host profile (measured before the ranks started): auto's prior is simulated on it.
    host = json.loads((Path(args.control) / HOST_PROFILE_FILE).read_text())

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[real_links] {msg}", file=sys.stderr, flush=True)

    under_transfer = _run_compute_under_transfer(plan, control, log)
    jobs = []
    for job in plan["jobs"]:
        jobs.append(run_job(job, plan, host, control, rank, world, log, under_transfer))
        if rank == 0:  # after every job: a run cut short by its timeout keeps what it measured
            tmp = Path(args.control) / "result.json.tmp"
            tmp.write_text(json.dumps({"plan": plan, "jobs": jobs, "complete": len(jobs) == len(plan["jobs"])}, indent=1))
            tmp.rename(Path(args.control) / "result.json")
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- one host


def aten_share(model: str = "small-moe", tokens: int = 64, context_len: int = 256, threads: int = 1) -> dict:
    """Where a `tokens`-request decode step of `model` spends its time on one rank: the torch
    profiler's self CPU time of ATen ops against the step's wall time (the rest is Python:
    the runner, the model's module code, the kernel's bookkeeping)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    workload = _workload({"workload": model, "phase": "decode", "tokens": tokens}, {"context_len": context_len}, 0, 1)
    for _ in range(2):
        workload.measure("none", tokens)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        steps = 3
        for _ in range(steps):
            workload.measure("none", tokens)
        wall = (time.perf_counter() - start) / steps
    aten = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::")) / 1e6 / steps
    top = sorted((e for e in prof.key_averages() if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)[:5]
    return {
        "model": model, "decode_requests": tokens, "context_len": context_len, "threads": threads,
        "step_wall_s": wall, "aten_self_cpu_s": aten, "aten_share": aten / wall,
        "top_ops": {e.key: e.self_cpu_time_total / 1e6 / steps for e in top},
    }


def scheduler_loops(model: str = "small-moe", streams: int = 64, max_tokens: int = 16, repeat: int = 3, threads: int = 1) -> dict:
    """The engine's overlapped scheduler loop against the normal one on one rank: `streams`
    requests generating `max_tokens` each (ignore EOS), output tokens/s, median of
    `repeat` runs of each, interleaved."""
    import torch

    import dataclasses

    from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.build import build_engine
    from tandem.engine.offline import build_runner
    from tandem.worker.sampling import SamplingParams

    torch.set_num_threads(threads)
    config = EngineConfig(model=model, cache=CacheConfig(num_kv_blocks=streams * 4 + 8), device="cpu", dtype="float32")
    runner = build_runner(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 200 for j in range(24)] for i in range(streams)]

    host_share: list[float] = []

    def run(overlap: bool) -> tuple[float, list]:
        scheduler = SchedulerConfig(max_num_seqs=streams, overlap_schedule=overlap)
        engine = build_engine(dataclasses.replace(config, scheduler=scheduler), runner=runner)
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", ids, params)
        start, tokens = time.perf_counter(), {}
        while engine.has_work:
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        wall = time.perf_counter() - start
        if not overlap:  # the host work the overlapped loop can hide: the normal loop's time outside forwards
            host_share.append(1 - engine.forward_busy_s / wall)
        return sum(len(v) for v in tokens.values()) / wall, [tokens[f"r{i}"] for i in range(streams)]

    run(True)  # warm-up
    rates: dict[str, list[float]] = {"normal": [], "overlap": []}
    outputs = {}
    for _ in range(repeat):
        for name in rates:
            tok_s, outputs[name] = run(name == "overlap")
            rates[name].append(tok_s)
    medians = {k: _median(v) for k, v in rates.items()}
    return {
        "model": model, "streams": streams, "max_tokens": max_tokens, "threads": threads,
        "tok_s": medians, "samples_tok_s": rates, "overlap_over_normal": medians["overlap"] / medians["normal"],
        "same_tokens": outputs["normal"] == outputs["overlap"],
        "normal_loop_host_share": _median(host_share),
    }


# --------------------------------------------------------------------------- driver


def _env_with_src(env: dict) -> dict:
    src = str(HERE.parent / "src")
    env = dict(env)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_cluster(plan: dict, host: dict, *, timeout_s: float) -> dict:
    """Run the plan on 2 namespace hosts (`host`: the profile auto's prior is simulated on);
    return rank 0's results plus the link settings."""
    from tandem.testing.netns_cluster import NetnsCluster, namespaces_available, torchrun_argv

    ok, reason = namespaces_available()
    if not ok:
        raise RuntimeError(f"real-link benchmark needs network namespaces: {reason}")
    with tempfile.TemporaryDirectory(prefix="tdr-real-links-") as tmp:
        plan_file = Path(tmp) / "plan.json"
        plan_file.write_text(json.dumps(plan))
        (Path(tmp) / HOST_PROFILE_FILE).write_text(json.dumps(host))
        control = Control(tmp)
        with NetnsCluster(2, rate_mbit=None, prefix="tdr") as cluster:
            master = cluster.hosts[0].address
            port = 29500 + os.getpid() % 1000
            procs = []
            for i in range(2):
                argv = torchrun_argv(
                    nnodes=2, node_rank=i, master_addr=master, master_port=port,
                    args=[str(Path(__file__).resolve()), "--worker", "--plan", str(plan_file), "--control", tmp],
                    module=False,
                )
                procs.append(cluster.popen(i, argv, env=_env_with_src(cluster.env(i))))
            rates: list = []

            def act(req: dict) -> None:
                cluster.set_rate(req["rate_mbit"])
                rates.append(req["rate_mbit"])

            deadline = time.monotonic() + timeout_s
            timed_out = False
            try:
                while any(p.poll() is None for p in procs):
                    if time.monotonic() > deadline:
                        timed_out = True
                        print(f"[real_links] the ranks did not finish within {timeout_s:.0f} s: stopping them", file=sys.stderr)
                        break
                    if not control.serve_one(act):
                        time.sleep(0.02)
                    if any(p.poll() not in (None, 0) for p in procs):
                        break
            finally:
                for p in procs:  # torchrun passes SIGTERM on to its worker; SIGKILL would orphan it
                    if p.poll() is None:
                        p.terminate()
                for p in procs:
                    try:
                        p.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait(timeout=20)
            codes = [p.returncode for p in procs]
            partial = Path(tmp) / "result.json"
            if not timed_out and any(codes):
                raise RuntimeError(f"a rank failed (exit codes {codes}); see its output above")
            if not partial.exists():
                raise RuntimeError(f"no results: the ranks stopped (exit codes {codes}) before a job finished")
        result = json.loads(partial.read_text())
    result["link"] = {"hosts": 2, "qdisc": "tbf", "burst": "64kb", "latency_ms": 100.0, "rates_set_mbit": rates}
    return result


def _fmt_table(job: dict) -> str:
    modes = list(job["rows"][0]["step_s"])
    head = f"{job['workload']} {job['phase']}, {job['tokens']} tokens/rank  (ms; x = none / mode; f = mode / floor)"
    lines = [head, f"{'rate Mbit/s':>11} {'comm/comp':>9} {'compute':>8} {'comm':>8} {'floor':>8}  " + "  ".join(f"{m:>22}" for m in modes)]
    for r in job["rows"]:
        cells = "  ".join(
            f"{r['step_s'][m] * 1e3:8.1f} {r['vs_none'][m]:5.2f}x {r['vs_floor'][m]:4.2f}f" for m in modes
        )
        lines.append(
            f"{r['rate_mbit']:11.0f} {r['comm_over_compute']:9.2f} {r['compute_s'] * 1e3:8.1f} {r['comm_s'] * 1e3:8.1f} {r['floor_s'] * 1e3:8.1f}  {cells}"
        )
    return "\n".join(lines)


def goals(result: dict) -> list[dict]:
    """The issue's goals checked against this run's figures."""
    out = []
    jobs = {(j["workload"], j["phase"]): j for j in result["jobs"]}

    def row_near(job, ratio):
        return min(job["rows"], key=lambda r: abs(r["target_ratio"] - ratio))

    stack = jobs.get(("moe-stack", "prefill"))
    if stack is not None and stack["tokens"] == 512 and any(r["target_ratio"] == 1.0 for r in stack["rows"]):
        r = row_near(stack, 1.0)
        step = r["step_s"]
        dbo_modes = [m for m in ("dbo", "dbo-greenlet") if m in step]
        if dbo_modes:
            best = min(dbo_modes, key=step.get)
            out.append({"goal": "moe-stack prefill, comm≈compute: best DBO >= 1.5x none", "figure": r["vs_none"][best], "met": r["vs_none"][best] >= 1.5, "mode": best})
            out.append({"goal": "moe-stack prefill, comm≈compute: best DBO <= 1.15x floor", "figure": r["vs_floor"][best], "met": r["vs_floor"][best] <= 1.15, "mode": best})
            if "tbo" in step:
                ratio = step["tbo"] / step[best]
                out.append({"goal": "moe-stack prefill: TBO within 1.05x of DBO", "figure": ratio, "met": ratio <= 1.05})
        sbo = [m for m in step if m.startswith("sbo-")]
        if sbo:
            best_sbo = min(sbo, key=step.get)
            out.append({"goal": "moe-stack prefill, comm≈compute: best SBO >= 1.15x none", "figure": r["vs_none"][best_sbo], "met": r["vs_none"][best_sbo] >= 1.15, "mode": best_sbo})
    loops = result.get("scheduler_loops")
    if loops is not None:
        out.append({"goal": f"overlapped scheduler loop vs normal, {loops['model']} {loops['streams']} streams >= 1.05x", "figure": loops["overlap_over_normal"], "met": loops["overlap_over_normal"] >= 1.05})
    for job in result["jobs"]:
        for r in job["rows"]:
            if "auto" in r["step_s"]:
                out += _auto_goals(f"{job['workload']} {job['phase']} @ {r['rate_mbit']:.0f} Mbit/s", r)
    return out


#: The issue's bound on auto: within this factor of the best static mode, from the first step.
AUTO_BOUND = 1.03
#: The choices auto has in the bench (`tandem.bench.modes`: the planner over none and DBO on the
#: thread executor): it cannot pick tbo, greenlet or SBO.
AUTO_CHOICES = ("none", "dbo")


def _auto_goals(where: str, row: dict) -> list[dict]:
    """auto against the best static mode and against the best of its own choices (medians), each
    with whether the repeats resolve the verdict at `AUTO_BOUND`."""
    step, samples = row["step_s"], row["samples_s"]
    out = []
    for against, modes in (("best static", [m for m in step if m != "auto"]),
                           ("best of its choices", [m for m in AUTO_CHOICES if m in step])):
        best = min(modes, key=step.get)
        ratio = step["auto"] / step[best]
        met = ratio <= AUTO_BOUND
        out.append({"goal": f"auto <= {AUTO_BOUND}x {against} ({where})", "mode": best, "figure": ratio, "met": met,
                    "resolved": _bound_resolved(samples["auto"], samples[best], AUTO_BOUND, met)})
    return out


def _bound_resolved(auto: list[float], best: list[float], bound: float, met: bool) -> bool:
    """Whether the repeats resolve "auto <= bound x best" the way the medians decide it (as the
    signs' `_sign_resolved` does): met, with every repeat of auto within `bound` of every repeat
    of best; missed, with none of them."""
    if not auto or not best:
        return False
    return max(auto) <= bound * min(best) if met else min(auto) > bound * max(best)


def _describe_auto(row: dict) -> str:
    """'prior dbo/none 0.88 (dbo); ran dbo | dbo dbo dbo': the prior's predicted ratio and pick,
    then the choice of each step, warm-up | kept."""
    prior, choices = row.get("auto_prior"), row.get("auto_choices", {})
    if prior is None:
        head = "no prior"
    else:
        (sweep,) = [rows for rows in prior["sweep"].values() if rows]
        ratio = sweep[0]["dbo_ms"] / sweep[0]["none_ms"]
        head = f"prior dbo/none {ratio:.2f} ({'dbo' if ratio < 1 else 'none'})"
    ran = " ".join(choices.get("warmup", [])) + " | " + " ".join(choices.get("measured", []))
    return f"{head}; ran {ran}"


def _auto_table(result: dict) -> str:
    """Per row: the prior's predicted dbo / none, the choice auto ran each step, and auto against
    the best static mode and the best of its choices ('?': the repeats do not resolve it)."""
    lines = ["auto: the planner over none / dbo (threads), starting from the simulator's none and dbo at each row",
             f"{'job':<22}{'Mbit/s':>7}  {'prior and the choice of each step (warm-up | kept)':<52}{'auto':>6}"
             f"  {'/ best static':<28}{'/ best of none, dbo':<22}/ the mode it ran"]
    for job in result["jobs"]:
        for r in job["rows"]:
            if "auto" not in r["step_s"]:
                continue
            cells = []
            for g in _auto_goals("", r):
                mark = ("" if g["met"] else " MISS") + ("" if g["resolved"] else "?")
                cells.append(f"{g['figure']:.2f}x {g['mode']}{mark}")
            lines.append(f"{job['workload'] + ' ' + job['phase']:<22}{r['rate_mbit']:7.0f}  {_describe_auto(r):<52}"
                         f"{r['step_s']['auto'] * 1e3:6.0f}  {cells[0]:<28}{cells[1]:<22}{_auto_over_its_choice(r)}")
    return "\n".join(lines)


def _auto_over_its_choice(row: dict) -> str:
    """auto over the static mode of the one choice it ran on every kept step: what the planner
    itself costs apart from its choice: on the MoE stack, the agreement all-reduce over the link
    (`decide_overlap`), which the stack's static modes skip and a model step pays in every mode.
    Empty where auto ran more than one choice."""
    ran = set(row.get("auto_choices", {}).get("measured", []))
    static = {"none": "none", "dbo-2": "dbo"}.get(ran.pop()) if len(ran) == 1 else None
    if static is None or static not in row["step_s"]:
        return ""
    return f"{row['step_s']['auto'] / row['step_s'][static]:.2f}x {static}"


def report(result: dict) -> str:
    parts = [_fmt_table(job) for job in result["jobs"]]
    if any("auto" in r["step_s"] for job in result["jobs"] for r in job["rows"]):
        parts.append(_auto_table(result))
    if "aten_share" in result:
        a = result["aten_share"]
        parts.append(
            f"{a['model']} decode step, {a['decode_requests']} requests, one rank, {a['threads']} thread: wall "
            f"{a['step_wall_s'] * 1e3:.0f} ms, ATen self CPU {a['aten_self_cpu_s'] * 1e3:.0f} ms ({a['aten_share']:.0%} tensor work)"
        )
    if "scheduler_loops" in result:
        lo = result["scheduler_loops"]
        parts.append(
            f"scheduler loop, {lo['model']}, {lo['streams']} streams x {lo['max_tokens']} tokens, one rank: normal "
            f"{lo['tok_s']['normal']:.0f} tok/s, overlapped {lo['tok_s']['overlap']:.0f} tok/s "
            f"({lo['overlap_over_normal']:.2f}x; same tokens: {lo['same_tokens']}); the normal loop spends "
            f"{lo['normal_loop_host_share']:.1%} of its time outside forwards"
        )
    lines = ["goals:"]
    for g in result.get("goals", []):
        lines.append(f"  [{'met' if g['met'] else 'MISSED'}] {g['goal']}: {g['figure']:.2f}" + (f" ({g['mode']})" if "mode" in g else "")
                     + ("" if g.get("resolved", True) else ": the repeats do not resolve it"))
    return "\n\n".join(parts + ["\n".join(lines)])


def markdown(result: dict) -> str:
    """The tables and goals as Markdown (for benchmarks/README.md)."""
    out = []
    for job in result["jobs"]:
        modes = list(job["rows"][0]["step_s"])
        out.append(f"**{job['workload']} {job['phase']}, {job['tokens']} tokens/rank** (ms; x = none / mode; f = mode / floor)\n")
        out.append("| rate Mbit/s | comm/compute | compute | comm | floor | " + " | ".join(modes) + " |")
        out.append("|" + "---|" * (5 + len(modes)))
        for r in job["rows"]:
            cells = " | ".join(f"{r['step_s'][m] * 1e3:.0f} ({r['vs_none'][m]:.2f}x, {r['vs_floor'][m]:.2f}f)" for m in modes)
            out.append(
                f"| {r['rate_mbit']:.0f} | {r['comm_over_compute']:.2f} | {r['compute_s'] * 1e3:.0f} | {r['comm_s'] * 1e3:.0f} | "
                f"{r['floor_s'] * 1e3:.0f} | {cells} |"
            )
        out.append("")
    if "aten_share" in result:
        a = result["aten_share"]
        out.append(
            f"{a['model']} decode step, {a['decode_requests']} requests over a {a['context_len']}-token context, one rank, "
            f"{a['threads']} thread: {a['step_wall_s'] * 1e3:.0f} ms wall, {a['aten_self_cpu_s'] * 1e3:.0f} ms self CPU "
            f"in ATen ops ({a['aten_share']:.0%}).\n"
        )
    if "scheduler_loops" in result:
        lo = result["scheduler_loops"]
        out.append(
            f"Scheduler loop, {lo['model']}, {lo['streams']} streams x {lo['max_tokens']} tokens, one rank: normal "
            f"{lo['tok_s']['normal']:.1f} tok/s, overlapped {lo['tok_s']['overlap']:.1f} tok/s "
            f"({lo['overlap_over_normal']:.2f}x; identical tokens: {lo['same_tokens']}); the normal loop spends "
            f"{lo['normal_loop_host_share']:.1%} of its time outside forwards (the most an overlapped loop can hide).\n"
        )
    out.append("| goal | figure | |\n|---|---|---|")
    for g in result.get("goals", []):
        verdict = ("met" if g["met"] else "**missed**") + ("" if g.get("resolved", True) else " (not resolved by the repeats)")
        out.append(f"| {g['goal']}{' (' + g['mode'] + ')' if 'mode' in g else ''} | {g['figure']:.2f} | {verdict} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: one small moe-stack shape, none, dbo and auto, one rate")
    parser.add_argument("--plan-json", help="a plan (JSON) instead of the full or quick one")
    parser.add_argument("--out", default=str(RESULT), help="where to write the JSON")
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds before the run is abandoned")
    parser.add_argument("--markdown", metavar="JSON", help="print a results file's tables as Markdown and exit")
    parser.add_argument("--predict", metavar="JSON", help="predict a results file's rows again (on its own host profile, "
                        "or one measured now if it has none), print them and exit")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    if args.predict:
        saved = json.loads(Path(args.predict).read_text())
        host = saved.get("host_profile") or measure_host()
        print(format_predictions(predict(saved, host), host))
        return 0
    plan = json.loads(args.plan_json) if args.plan_json else quick_plan() if args.quick else full_plan()
    start = time.perf_counter()
    one_host = {}
    if plan.get("one_host", True):  # first: short, and a cluster run cut by its timeout keeps them
        print("[real_links] one host: ATen share of a decode step, scheduler loops", file=sys.stderr, flush=True)
        one_host["aten_share"] = aten_share(threads=plan["threads"])
        one_host["scheduler_loops"] = scheduler_loops(threads=plan["threads"])
        from tandem.models.small_moe import small_moe_tensor

        small_moe_tensor.cache_clear()  # the ranks need the memory now
    print("[real_links] the host profile (--hardware here: gloo over loopback, outside the namespaces)", file=sys.stderr, flush=True)
    host = measure_host()
    result = run_cluster(plan, host, timeout_s=max(args.timeout - (time.perf_counter() - start), 60.0))
    result.update(one_host)
    result["host_profile"] = host
    result["predictions"] = predict(result, host)
    result["wall_s"] = time.perf_counter() - start
    result["goals"] = goals(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(report(result))
    print("\n" + format_predictions(result["predictions"], host))
    if not result.get("complete", True):
        print(f"\nINCOMPLETE: {len(result['jobs'])} of {len(plan['jobs'])} jobs finished before the timeout")
    print(f"\nwrote {out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
