"""Where `--overlap-policy auto` starts when it has no tune file: the simulator's prediction for
the model and the hardware the ranks run on, computed once by the command that starts them.

`tandem serve` and `tandem generate` (`with_simulated_prior`) put it in the config, so every
rank's planner gets the same document; `tandem bench` (`cli_bench.auto_prior`) writes it to the
tune file its ranks read. Which hardware (`prior_hardware`): on the CPU, this host with the
ranks' count of gloo ranks, measured now (`here`); on CUDA, the built-in profile whose name the
device's carries (`hardware_for_device_name`). Where there is none to take (one rank, a modelled
fabric, pipeline stages, another GPU, a model the simulator cannot shape) the planner starts
from nothing and the command says why, in one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable

from tandem import tune_sweep
from tandem.simulate.hardware import HERE, PROFILES

#: The sweep the prior predicts: `tandem tune`'s default sizes and contexts, so the prior is the
#: document `tandem tune --simulate HW` writes for the same layout.
PRIOR_GRIDS = {"decode": list(tune_sweep.DECODE_TOKENS), "prefill": list(tune_sweep.PREFILL_TOKENS)}
PRIOR_CONTEXTS = {"decode": tune_sweep.CONTEXT_LEN, "prefill": tune_sweep.PREFILL_LEN}

_GPU_NAME = re.compile(r"\b(" + "|".join(PROFILES) + r")\b")


@dataclass(frozen=True)
class StartingPrior:
    """The tune document `auto` starts from (None: nothing) and the line that says so."""

    document: dict | None
    message: str


def hardware_for_device_name(name: str) -> str | None:
    """The built-in profile of a CUDA device by its name (`torch.cuda.get_device_name`, e.g.
    'NVIDIA H100 80GB HBM3' -> 'h100'); None when the name carries no profile's name, or more
    than one. Whole words only: a GH200 or an H20 is another GPU than the profile describes."""
    found = set(_GPU_NAME.findall(name.lower()))
    return found.pop() if len(found) == 1 else None


def prior_hardware(*, device_type: str, ranks: int, pipeline_stages: int = 1, modelled_fabric: bool = False,
                   torchrun: bool = False, device_name: Callable[[], str] | None = None,
                   all2all_backend: str | None = None) -> tuple[str | None, str]:
    """(the hardware the prior is simulated on, or None; why none). `device_name` names the
    CUDA device (asked only on CUDA). On CUDA the profiles price DeepEP's kernels, so another
    `all2all_backend` (NCCL's all-to-all under torch_a2a) gets none."""
    if pipeline_stages > 1:
        return None, f"the simulator models DP attention x EP ranks, not {pipeline_stages} pipeline stages"
    if ranks < 2:
        return None, "one rank has no all-to-all for overlap to hide"
    if modelled_fabric:
        return None, "a modelled interconnect's transfers are sleeps, not this host's to predict"
    if device_type == "cpu":
        if torchrun:
            return None, ("under torchrun each process is one rank and measuring this host needs ranks of its own; "
                          "write the prior with `tandem tune --simulate here` and pass --thresholds-file")
        return HERE, ""
    if device_type != "cuda" or device_name is None:
        return None, f"no hardware profile for a {device_type} device"
    if all2all_backend is not None and not all2all_backend.startswith("deepep"):
        return None, f"the GPU profiles model DeepEP's kernels, not the {all2all_backend} backend"
    try:
        name = device_name()
    except (RuntimeError, AssertionError) as exc:
        return None, f"the CUDA device's name is not known ({exc})"
    hardware = hardware_for_device_name(name)
    if hardware is None:
        return None, (f"no built-in hardware profile for {name!r} ({', '.join(PROFILES)}); write the prior with "
                      "`tandem tune --simulate PROFILE.json` and pass --thresholds-file")
    return hardware, ""


def predicted_ratios(document: dict, phases: tuple[str, ...]) -> str:
    """'decode 8: 2.10x, 16: ... | prefill ...': the prior's DBO / none step per size."""
    def ratios(phase: str) -> str:
        return ", ".join(f"{r['tokens_per_rank']}: {r['dbo_ms'] / r['none_ms']:.2f}x" for r in document["sweep"][phase])

    if len(phases) == 1:
        return ratios(phases[0])
    return "; ".join(f"{phase} {ratios(phase)}" for phase in phases)


def simulate_prior(model: str, hardware: str, *, ranks: int, num_ubatches: int, grids: dict[str, list[int]],
                   contexts: dict[str, int], phases: tuple[str, ...] = ("decode", "prefill"),
                   margin: float = tune_sweep.MARGIN) -> StartingPrior:
    """The simulator's tune document for `model` on `hardware` (a profile, or `here`: measured
    now, after the model is known to be one the simulator takes), and its line: the predicted
    DBO / none ratios of `phases`, or why there is no prior. Never raises for a model or a
    measurement the simulator cannot take: the planner then starts from nothing."""
    from tandem.simulate import host
    from tandem.simulate.model_shape import model_shape
    from tandem.simulate.prior import simulated_tune

    def none(why: str) -> StartingPrior:
        return StartingPrior(None, f"auto starts with no prior: {why}")

    try:
        model_shape(model)
    except Exception as exc:  # noqa: BLE001 - any config the simulator cannot read is "cannot model"
        return none(f"the simulator cannot model {model} ({exc})")
    try:
        profile = host.resolve_hardware(hardware, ranks)
    except Exception as exc:  # noqa: BLE001 - a failed measurement starts from nothing; serving goes on
        return none(f"measuring --hardware {hardware} failed ({type(exc).__name__}: {exc})")
    try:
        _, document = simulated_tune(model, profile, ranks=ranks, num_ubatches=num_ubatches, grids=grids,
                                     contexts=contexts, margin=margin)
    except Exception as exc:  # noqa: BLE001 - a shape the op model cannot cost is "cannot model" too
        return none(f"the simulator cannot model {model} ({type(exc).__name__}: {exc})")
    return StartingPrior(document, f"auto starts from tandem simulate --hardware {hardware}: DBO / none predicted "
                                   f"{predicted_ratios(document, phases)}")


def with_simulated_prior(config, *, torchrun: bool = False, log: Callable[[str], None] = lambda line: None):
    """`config` with the simulated prior its `auto` planner starts from (`serve`, `generate`):
    under `--overlap-policy auto` with DBO, no `--thresholds-file` and `--overlap-prior
    simulate`; else `config` as it is. Says on `log` what the prior predicts, or why there is none."""
    o, p = config.overlap, config.parallel
    if o.overlap_policy != "auto" or not o.enable_dbo or o.thresholds_file or o.overlap_prior == "none":
        return config
    from tandem.platform.device import resolve_device

    device = resolve_device(config.device)
    modelled = any(v is not None for v in (p.fabric, p.fabric_latency_us, p.fabric_gbps))
    hardware, why_not = prior_hardware(
        device_type=device.type, ranks=p.data_parallel_size, pipeline_stages=p.pipeline_parallel_size,
        modelled_fabric=modelled, torchrun=torchrun, device_name=lambda: _cuda_device_name(device),
        all2all_backend=p.all2all_backend,
    )
    if hardware is None:
        log(f"auto starts with no prior: {why_not}")
        return config
    if hardware == HERE:
        log(f"auto: measuring this host for the simulator's prior ({p.data_parallel_size} gloo ranks; "
            "--overlap-prior none starts from nothing)")
    prior = simulate_prior(config.model, hardware, ranks=p.data_parallel_size, num_ubatches=o.num_ubatches,
                           grids=PRIOR_GRIDS, contexts=PRIOR_CONTEXTS)
    log(prior.message)
    if prior.document is None:
        return config
    return replace(config, overlap=replace(o, simulated_prior=prior.document))


def _cuda_device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device)


__all__ = [
    "PRIOR_CONTEXTS", "PRIOR_GRIDS", "StartingPrior", "hardware_for_device_name", "predicted_ratios",
    "prior_hardware", "simulate_prior", "with_simulated_prior",
]
