"""The overlap planner (`--overlap-policy auto`): for each step, predict the step time of
every enabled way to run it and take the fastest.

The choices are no overlap, SBO alone (when SBO is enabled) and DBO with 2..N ubatches
(with the configured executor; its MoE layers keep SBO when it is on). The prediction is a
cost model fitted online to the runtime's own time model (`StepTimes`):
`tandem.ubatch.cost_model` (compute, communication and the cost of splitting, each fitted
by least squares, and a measured correction per choice).

Until the fit has data the planner follows `tandem tune`'s sweep when given one (the
none / DBO step times, interpolated: measured by `tandem tune`, or predicted by `tandem tune
--simulate` and by `tandem bench` for this host), else the static thresholds. Once the fit has
data, a choice it has not measured yet keeps the prior's ratio to no overlap, so the planner
does not try a split the prior says loses just because the fit cannot price one yet. A bounded
share of steps (at most 5 %) runs another feasible choice than the predicted best, the one
gone longest unrun at that step size, so the model of choices not taken stays honest. It
reads only agreed values (the step index, the agreed choices and padded sizes, the seed
for ties), so every DP rank explores the same step the same way. DP ranks agree on the
choice in the all-reduce `coordinate_ubatching` already does: each sends its
predictions, all take the choice whose slowest rank is fastest.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tandem.ubatch.coordination import UBatchDecision
from tandem.ubatch.cost_model import OverlapChoice, OverlapCostModel, StepMeasurement, StepShape

#: The most a planner may explore.
MAX_EXPLORE_SHARE = 0.05
DEFAULT_EXPLORE_SHARE = 0.03
#: A choice not run in this many steps of a size class is due for exploration there,
#: if its predicted time is within this factor of the best's.
STALE_VISITS = 4
EXPLORE_WITHIN = 1.5


def overlap_choices(max_ubatches: int, *, dbo: bool, sbo: bool) -> list[OverlapChoice]:
    """No overlap, SBO alone when enabled, then DBO with 2..`max_ubatches` ubatches when enabled."""
    choices = [OverlapChoice("none", 1, False)]
    if sbo:
        choices.append(OverlapChoice("sbo", 1, True))
    if dbo:
        choices += [OverlapChoice(f"dbo-{k}", k, sbo) for k in range(2, max_ubatches + 1)]
    return choices


@dataclass
class TunePrior:
    """`tandem tune`'s sweep: measured step seconds of no overlap and of DBO (with the
    tune run's ubatch count) per phase and token count."""

    #: phase ("decode" / "prefill") -> ascending [(tokens, none_s, dbo_s)].
    tables: dict[str, list[tuple[int, float, float]]]
    num_ubatches: int = 2

    @classmethod
    def from_file(cls, path: str | Path) -> "TunePrior":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the tune file {path}: {exc}") from None
        return cls.from_document(data, f"tune file {path}")

    @classmethod
    def from_document(cls, data: dict, source: str = "the tune document") -> "TunePrior":
        """A `tandem tune` document already in memory (a simulated prior in the config)."""
        sweep = data.get("sweep")
        if not isinstance(sweep, dict):
            raise ValueError(f"{source} has no 'sweep' table (write it with `tandem tune`)")
        tables = {
            phase: sorted((int(r["tokens_per_rank"]), r["none_ms"] / 1e3, r["dbo_ms"] / 1e3) for r in rows)
            for phase, rows in sweep.items()
        }
        return cls(tables, int(data.get("config", {}).get("num_ubatches", 2)))

    def predict(self, choice: OverlapChoice, shape: StepShape) -> float:
        table = self.tables.get("decode" if shape.decode else "prefill")
        if not table or choice.sbo or choice.num_ubatches not in (1, self.num_ubatches):
            return math.inf
        column = 1 if choice.num_ubatches == 1 else 2
        points = [(row[0], row[column]) for row in table]
        tokens = max(shape.num_tokens, 1)
        if tokens <= points[0][0]:
            return points[0][1]
        for (t0, y0), (t1, y1) in zip(points, points[1:]):
            if tokens <= t1:
                return y0 + (y1 - y0) * (tokens - t0) / (t1 - t0)
        last_t, last_y = points[-1]
        return last_y * tokens / last_t


@dataclass
class PlannerStats:
    """What `/metrics` shows: how often each choice ran, predicted against measured."""

    choices: dict[str, int] = field(default_factory=dict)
    explored_steps: int = 0
    predicted_steps: int = 0
    predicted_s: float = 0.0
    measured_s: float = 0.0
    abs_error_s: float = 0.0

    def __add__(self, other: PlannerStats) -> PlannerStats:
        """Two planners' counters as one (ranks' planners, each learning its own steps)."""
        choices = dict(self.choices)
        for name, count in other.choices.items():
            choices[name] = choices.get(name, 0) + count
        return PlannerStats(
            choices=choices,
            explored_steps=self.explored_steps + other.explored_steps,
            predicted_steps=self.predicted_steps + other.predicted_steps,
            predicted_s=self.predicted_s + other.predicted_s,
            measured_s=self.measured_s + other.measured_s,
            abs_error_s=self.abs_error_s + other.abs_error_s,
        )



@dataclass(frozen=True)
class PlannedStep:
    choice: OverlapChoice
    #: This rank's prediction for the choice taken (inf when it had none).
    predicted_s: float
    explored: bool


class OverlapPlanner:
    """One rank's planner. Per step: `predict` (send the list in the DP all-reduce), then
    `choose` with the agreed predictions, then `observe` the measured step."""

    def __init__(
        self,
        choices: Sequence[OverlapChoice],
        *,
        explore_share: float = DEFAULT_EXPLORE_SHARE,
        seed: int = 0,
        prior: TunePrior | None = None,
    ):
        if not choices or choices[0].num_ubatches != 1 or choices[0].sbo:
            raise ValueError("the first overlap choice must be no overlap")
        if not 0.0 <= explore_share <= MAX_EXPLORE_SHARE:
            raise ValueError(f"explore share must lie in [0, {MAX_EXPLORE_SHARE}], got {explore_share}")
        self.choices = list(choices)
        self.explore_share = explore_share
        self.seed = seed
        self.prior = prior
        self.model = OverlapCostModel(self.choices)
        self.stats = PlannerStats(choices={c.name: 0 for c in self.choices})
        self._steps = 0
        self._explored = 0
        #: Per agreed size class: steps seen, and the visit at which each choice last ran.
        self._visits: dict[int, int] = {}
        self._last_run: dict[tuple[int, int], int] = {}

    def predict(self, shape: StepShape) -> list[float]:
        """Predicted step seconds per choice (inf where nothing is known yet). Once the fit
        has data, a choice it has not measured yet keeps the prior's verdict: the fitted
        unsplit step times the prior's ratio of that choice to no overlap (the fit alone
        knows nothing of a split's cost until a split step ran)."""
        if not self.model.ready:
            if self.prior is not None:
                return [self.prior.predict(c, shape) for c in self.choices]
            return [math.inf] * len(self.choices)
        fitted = [self.model.predict(c, shape) for c in self.choices]
        if self.prior is None:
            return fitted
        prior = [self.prior.predict(c, shape) for c in self.choices]
        if not 0 < prior[0] < math.inf:
            return fitted
        keeps_prior = [not self.model.measured(c) and math.isfinite(p) for c, p in zip(self.choices, prior)]
        return [fitted[0] * p / prior[0] if keep else f for f, p, keep in zip(fitted, prior, keeps_prior)]

    def choose(
        self,
        agreed_s: Sequence[float],
        feasible: Sequence[bool],
        fallback: OverlapChoice,
        own_s: Sequence[float] | None = None,
        *,
        size_key: int = 0,
    ) -> PlannedStep:
        """The choice for this step from the agreed (slowest-rank) predictions; `fallback`
        (the static rule's choice, agreed by every rank) while some feasible choice has no
        prediction.

        Exploration: while the explored steps stay within `explore_share` of all steps, a
        step runs instead of the best the feasible choice that has gone longest unrun at
        this `size_key` (an agreed size class, e.g. the padded token count's log2), if
        it has not run in the last `STALE_VISITS` steps of that class and is predicted
        within `EXPLORE_WITHIN` of the best. Everything it reads
        is agreed, so identical inputs give an identical choice on every rank.
        """
        step, self._steps = self._steps, self._steps + 1
        candidates = [i for i, ok in enumerate(feasible) if ok]
        if not candidates:
            raise ValueError("no overlap choice is feasible for this step (no-overlap always is)")
        if any(math.isinf(agreed_s[i]) for i in candidates):
            best = self.choices.index(fallback)
        else:
            best = min(candidates, key=lambda i: (agreed_s[i], i))
        visits = self._visits.get(size_key, 0)
        self._visits[size_key] = visits + 1
        last = lambda i: self._last_run.get((size_key, i), -STALE_VISITS - 1)  # noqa: E731
        # Only a choice that could plausibly win is worth a step: one predicted far slower
        # would have to be mispredicted by more than the correction's usual range.
        plausible = lambda i: not agreed_s[i] > EXPLORE_WITHIN * agreed_s[best]  # noqa: E731
        stale = [i for i in candidates if i != best and visits - last(i) > STALE_VISITS and plausible(i)]
        explored = bool(stale) and self._explored + 1 <= self.explore_share * (step + 1)
        if explored:
            oldest = min(last(i) for i in stale)
            stalest = [i for i in stale if last(i) == oldest]
            best = stalest[random.Random(self.seed * 7_919 + step).randrange(len(stalest))]
            self._explored += 1
        self._last_run[(size_key, best)] = visits
        own = own_s if own_s is not None else agreed_s
        return PlannedStep(self.choices[best], own[best], explored)

    def static_choice(self, num_ubatches: int) -> OverlapChoice:
        """What the static rule runs with `num_ubatches` (1: no split, SBO when it is on), or
        the nearest smaller choice there is (a planner without DBO choices: no split)."""
        return next(c for c in reversed(self.choices) if c.num_ubatches <= num_ubatches)

    def decide(self, decision: UBatchDecision, static_num_ubatches: int, own_s: Sequence[float]) -> PlannedStep:
        """`choose` for a `coordinate_ubatching` decision that carried `own_s`: choices whose
        last ubatch would be padding on some rank are out; the static rule (its agreed
        ubatch count) is the fallback."""
        feasible = [c.num_ubatches == 1 or decision.fits(c.num_ubatches) for c in self.choices]
        return self.choose(
            decision.predicted_s, feasible, self.static_choice(static_num_ubatches), own_s=own_s,
            size_key=round(math.log2(max(decision.num_tokens_padded, 1))),
        )

    def observe(self, planned: PlannedStep, shape: StepShape, measured: StepMeasurement) -> None:
        stats = self.stats
        stats.choices[planned.choice.name] += 1
        stats.explored_steps += planned.explored
        if not math.isinf(planned.predicted_s):
            stats.predicted_steps += 1
            stats.predicted_s += planned.predicted_s
            stats.measured_s += measured.step_s
            stats.abs_error_s += abs(planned.predicted_s - measured.step_s)
        self.model.observe(planned.choice, shape, measured)


__all__ = [
    "DEFAULT_EXPLORE_SHARE",
    "MAX_EXPLORE_SHARE",
    "OverlapChoice",
    "OverlapCostModel",
    "OverlapPlanner",
    "PlannedStep",
    "PlannerStats",
    "StepMeasurement",
    "StepShape",
    "TunePrior",
    "overlap_choices",
]
