"""The simulator's answer in `tandem tune`'s format: per phase and token count, the predicted
step of no overlap and of DBO, and the thresholds from which DBO wins.

`tandem tune --simulate HW` writes it for a cluster you don't have; `--overlap-policy auto`
reads it as its prior (`tandem.ubatch.planner.TunePrior`: the same reader as a measured tune
file), and `tandem bench` hands `auto` the prior for this host (`here`) when it has no tune
file. The thresholds come from `tandem.bench.tune.choose_threshold`, the rule a measured sweep
goes through. `simulated_step_tune` writes the document of one step (benchmarks/real_links.py:
each row's prior at its link), and `agreed_document` hands one rank's document to every rank.
"""

from __future__ import annotations

from typing import Callable

from tandem.bench.modes import PHASES
from tandem.bench.moe_stack import MOE_STACK
from tandem.bench.tune import Decision, choose_threshold, tune_document
from tandem.simulate.hardware import HardwareProfile
from tandem.simulate.run import simulate


def simulated_decisions(
    model: str,
    hardware: HardwareProfile,
    *,
    ranks: int,
    num_ubatches: int,
    grids: dict[str, list[int]],
    contexts: dict[str, int],
    margin: float,
) -> list[Decision]:
    """`tandem tune`'s verdict per phase from the simulator: `grids` maps each phase to its
    token counts per rank, `contexts` each phase to its context (decode: cached tokens per
    request; prefill: prompt length). On a host whose cores do the transfers, the low-latency
    kernels are not modelled (`simulate`'s default there: gloo's all-to-all is the normal path)."""
    if num_ubatches < 2:
        raise ValueError(f"a DBO prior needs at least 2 ubatches, got {num_ubatches}")
    if sorted(grids) != sorted(PHASES):
        raise ValueError(f"a tune document has a sweep for each phase ({', '.join(PHASES)}), got {sorted(grids)}")
    decisions = []
    for phase, tokens_list in grids.items():
        # The bench's MoE stack attends to no cache: one key per query prices its stand-in alone.
        context = 1 if model == MOE_STACK else contexts[phase]
        sizes = _simulated_sizes(model, hardware, ranks=ranks, num_ubatches=num_ubatches, phase=phase,
                                 tokens_list=tokens_list, context=context)
        decisions.append(choose_threshold(phase, sizes, margin))
    return decisions


def _simulated_sizes(model: str, hardware: HardwareProfile, *, ranks: int, num_ubatches: int, phase: str,
                     tokens_list: list[int], context: int) -> list[tuple[int, float, float]]:
    """(tokens, none ms, DBO ms) per size: the rows of a tune document's sweep."""
    dbo = f"dbo{num_ubatches}"
    sizes = []
    for tokens in tokens_list:
        none, split = simulate(
            model, hardware, ep=ranks, phase=phase, tokens_per_rank=tokens, context=context, modes=("none", dbo),
        ).results
        sizes.append((tokens, round(none.step_s * 1e3, 4), round(split.step_s * 1e3, 4)))
    return sizes


def simulated_tune(model: str, hardware: HardwareProfile, *, ranks: int, num_ubatches: int,
                   grids: dict[str, list[int]], contexts: dict[str, int], margin: float) -> tuple[list[Decision], dict]:
    """`simulated_decisions` and the `tandem tune` document they make, the simulation's
    settings under config.simulated."""
    decisions = simulated_decisions(model, hardware, ranks=ranks, num_ubatches=num_ubatches, grids=grids,
                                    contexts=contexts, margin=margin)
    simulated = {"model": model, "hardware": hardware.name, "ranks": ranks, "contexts": contexts}
    return decisions, tune_document(decisions, margin, {"num_ubatches": num_ubatches, "simulated": simulated})


def simulated_step_tune(model: str, hardware: HardwareProfile, *, ranks: int, num_ubatches: int, phase: str,
                        tokens_per_rank: int, context: int, margin: float, costed_as: str | None = None) -> dict:
    """The `tandem tune` document of one step: the simulator's none and DBO (`num_ubatches`) for
    `phase` at `tokens_per_rank` over `context`, filed under `costed_as` (default `phase`), the
    phase the planner looks the step up in (the bench's MoE stack is costed as decode, whatever
    the phase it runs); the other phase's sweep is empty (no prior there: DBO off by its
    threshold). For a benchmark that knows the one step it runs, on a profile that may carry its
    link (`shaped_link.over_link`)."""
    costed_as = costed_as or phase
    if costed_as not in PHASES:
        raise ValueError(f"a step is costed as one of {', '.join(PHASES)}, got {costed_as!r}")
    sizes = _simulated_sizes(model, hardware, ranks=ranks, num_ubatches=num_ubatches, phase=phase,
                             tokens_list=[tokens_per_rank], context=context)
    decisions = [choose_threshold(p, sizes if p == costed_as else [], margin) for p in PHASES]
    simulated = {"model": model, "hardware": hardware.name, "ranks": ranks, "phase": phase, "context": context}
    return tune_document(decisions, margin, {"num_ubatches": num_ubatches, "simulated": simulated})


def agreed_document(make: Callable[[], dict | None], group=None) -> dict | None:
    """`make()` as rank 0 made it, on every rank of `group` (one broadcast; `make` runs on rank
    0 only). The planners' choices are agreed in an all-reduce of their predictions, so every
    rank must start from the same prior: one made where the inputs (a rank's own measurements)
    differ between ranks is made once and handed on. Without torch.distributed, `make()`. Where
    `make` fails on rank 0, every rank raises (none is left waiting for a document)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return make()
    box: list = [None]
    if dist.get_rank(group) == 0:
        try:
            box = [("document", make())]
        except Exception as exc:  # noqa: BLE001 - handed on, then raised on every rank
            box = [("failed", f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    kind, value = box[0]
    if kind == "failed":
        raise RuntimeError(f"rank 0 could not make the document every rank starts from: {value}")
    return value


__all__ = ["agreed_document", "simulated_decisions", "simulated_step_tune", "simulated_tune"]
