"""The simulator's answer in `tandem tune`'s format: per phase and token count, the predicted
step of no overlap and of DBO, and the thresholds from which DBO wins.

`tandem tune --simulate HW` writes it for a cluster you don't have; `--overlap-policy auto`
reads it as its prior (`tandem.ubatch.planner.TunePrior`: the same reader as a measured tune
file), and `tandem bench` hands `auto` the prior for this host (`here`) when it has no tune
file. The thresholds come from `tandem.bench.tune.choose_threshold`, the rule a measured sweep
goes through.
"""

from __future__ import annotations

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
    dbo = f"dbo{num_ubatches}"
    decisions = []
    for phase, tokens_list in grids.items():
        # The bench's MoE stack attends to no cache: one key per query prices its stand-in alone.
        context = 1 if model == MOE_STACK else contexts[phase]
        sizes = []
        for tokens in tokens_list:
            none, split = simulate(
                model, hardware, ep=ranks, phase=phase, tokens_per_rank=tokens, context=context,
                modes=("none", dbo),
            ).results
            sizes.append((tokens, round(none.step_s * 1e3, 4), round(split.step_s * 1e3, 4)))
        decisions.append(choose_threshold(phase, sizes, margin))
    return decisions


def simulated_tune(model: str, hardware: HardwareProfile, *, ranks: int, num_ubatches: int,
                   grids: dict[str, list[int]], contexts: dict[str, int], margin: float) -> tuple[list[Decision], dict]:
    """`simulated_decisions` and the `tandem tune` document they make, the simulation's
    settings under config.simulated."""
    decisions = simulated_decisions(model, hardware, ranks=ranks, num_ubatches=num_ubatches, grids=grids,
                                    contexts=contexts, margin=margin)
    simulated = {"model": model, "hardware": hardware.name, "ranks": ranks, "contexts": contexts}
    return decisions, tune_document(decisions, margin, {"num_ubatches": num_ubatches, "simulated": simulated})


__all__ = ["simulated_decisions", "simulated_tune"]
