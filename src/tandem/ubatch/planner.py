"""The overlap planner (`--overlap-policy auto`): for each step, predict the step time of
every enabled way to run it and take the fastest.

The choices are no overlap, SBO alone (when SBO is enabled) and DBO with 2..N ubatches
(with the configured executor; its MoE layers keep SBO when it is on). The prediction is a
cost model fitted online to the runtime's own time model (`StepTimes`):

- compute of an unsplit step: `a + b * tokens + c * attention` (attention = causal
  (query, key) pairs over the requests' contexts), least squares with exponential
  forgetting over the unsplit steps;
- communication of an unsplit step: `latency + tokens * per-token bytes / bandwidth`, the
  same way (the intercept holds the per-step transfer latencies);
- the measured cost of splitting into k ubatches: the k-split steps' compute less the
  unsplit prediction, fitted against tokens; plus their mean ubatch switch time;
- the step: unsplit `C + M`; k ubatches `max(Ck, Mk) + min(Ck, Mk) / k` (one ubatch's
  share cannot be hidden: the pipeline's fill and drain), where `Mk` pays the per-step
  latency k times (one link: the ubatches' transfers queue behind each other);
- a correction per choice: the median ratio of measured to structural step time over the
  choice's recent steps in the same size bucket, pulled toward the median over all its
  recent steps while the bucket holds few, else 1. The ratios are taken against the
  current fit at prediction time, so steps run before the fit was ready (the static
  rule's) count too, and a median, so a step slowed by a neighbour's load does not swing
  it. It learns what the structure misses (SBO's hidden combine, the transport's CPU cost
  under overlap, the pipeline's real fill and drain).

Until the fit has data the planner follows `tandem tune`'s sweep when given one (the
measured none / DBO step times, interpolated), else the static thresholds. A bounded
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
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from tandem.ubatch.coordination import UBatchDecision

#: The most a planner may explore.
MAX_EXPLORE_SHARE = 0.05
DEFAULT_EXPLORE_SHARE = 0.03
#: A choice not run in this many steps of a size class is due for exploration there,
#: if its predicted time is within this factor of the best's.
STALE_VISITS = 4
EXPLORE_WITHIN = 1.5
#: Unsplit observations needed before the fitted model is trusted over the prior.
MIN_OBSERVATIONS = 4
#: Recent steps per choice and size bucket, and per choice, whose median ratio of measured
#: to structural step time corrects the structure.
CORRECTION_WINDOW = 7
CHOICE_WINDOW = 32
#: Steps between re-pricing every cached correction against the current fit.
REPRICE_EVERY = 16
#: A bucket's own median counts as much as the choice-wide one once it holds this many steps.
SHRINK_STEPS = 2
#: Features are scaled so the least-squares problem is well conditioned.
_TOKEN_SCALE = 1e-3
_ATTENTION_SCALE = 1e-6


@dataclass(frozen=True)
class OverlapChoice:
    """One way to run a step: `num_ubatches` 1 is no split."""

    name: str
    num_ubatches: int
    sbo: bool


def overlap_choices(max_ubatches: int, *, dbo: bool, sbo: bool) -> list[OverlapChoice]:
    """No overlap, SBO alone when enabled, then DBO with 2..`max_ubatches` ubatches when enabled."""
    choices = [OverlapChoice("none", 1, False)]
    if sbo:
        choices.append(OverlapChoice("sbo", 1, True))
    if dbo:
        choices += [OverlapChoice(f"dbo-{k}", k, sbo) for k in range(2, max_ubatches + 1)]
    return choices


@dataclass(frozen=True)
class StepShape:
    """What the cost of a step depends on: the tokens this rank runs, the causal attention
    (query, key) pairs over its requests' contexts, and whether it is a uniform decode."""

    num_tokens: int
    attention: int = 0
    decode: bool = True

    @property
    def bucket(self) -> tuple[bool, int]:
        return self.decode, round(math.log2(max(self.num_tokens, 1)))


@dataclass(frozen=True)
class StepMeasurement:
    """A step's time model (the fields of `StepTimes` the planner reads)."""

    step_s: float
    compute_s: float
    comm_s: float
    switch_s: float


class _ForgettingLeastSquares:
    """Ridge least squares over exponentially down-weighted observations."""

    def __init__(self, dim: int, *, forget: float = 0.98, ridge: float = 1e-6):
        self.forget, self.ridge = forget, ridge
        self.gram = np.zeros((dim, dim))
        self.moment = np.zeros(dim)
        self.coef = np.zeros(dim)
        self.count = 0

    def update(self, x: Sequence[float], y: float) -> None:
        v = np.asarray(x, dtype=float)
        self.gram = self.forget * self.gram + np.outer(v, v)
        self.moment = self.forget * self.moment + v * y
        self.count += 1
        self.coef = np.linalg.solve(self.gram + self.ridge * np.eye(len(v)), self.moment)

    def predict(self, x: Sequence[float]) -> float:
        return float(np.dot(self.coef, x))


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
        sweep = data.get("sweep")
        if not isinstance(sweep, dict):
            raise ValueError(f"tune file {path} has no 'sweep' table (write it with `tandem tune`)")
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


class OverlapCostModel:
    """The fitted model of one rank's step time (see the module docstring)."""

    def __init__(self, choices: Sequence[OverlapChoice]):
        self.compute = _ForgettingLeastSquares(3)
        #: Compute of every step, split or not: what prices attention for cost-aware cuts
        #: (a planner that always splits still learns it).
        self.price = _ForgettingLeastSquares(3)
        self.comm = _ForgettingLeastSquares(2)
        splits = {c.num_ubatches for c in choices if c.num_ubatches > 1}
        self.split = {k: _ForgettingLeastSquares(2) for k in splits}
        self.switch_s = {k: 0.0 for k in splits}
        #: Recent (tokens, attention, step seconds) per choice, and per (choice, size bucket).
        self._recent: dict[str, deque[tuple[int, int, float]]] = {c.name: deque(maxlen=CHOICE_WINDOW) for c in choices}
        self._recent_in_bucket: dict[tuple[str, tuple[bool, int]], deque[tuple[int, int, float]]] = {}
        self._corrections: dict[tuple[str, tuple[bool, int]], float] = {}
        self._overall: dict[str, float | None] = {}
        self._observed = 0

    @property
    def ready(self) -> bool:
        return self.compute.count >= MIN_OBSERVATIONS and self.comm.count >= MIN_OBSERVATIONS

    @staticmethod
    def _compute_features(shape: StepShape) -> list[float]:
        return [1.0, shape.num_tokens * _TOKEN_SCALE, shape.attention * _ATTENTION_SCALE]

    @staticmethod
    def _comm_features(shape: StepShape) -> list[float]:
        return [1.0, shape.num_tokens * _TOKEN_SCALE]

    @property
    def attention_weight(self) -> float | None:
        """Fitted cost of one (query, key) pair over the cost of one token, or None while unknown."""
        per_token = self.price.coef[1] * _TOKEN_SCALE
        per_pair = self.price.coef[2] * _ATTENTION_SCALE
        if self.price.count < MIN_OBSERVATIONS or per_token <= 0 or per_pair < 0:
            return None
        return per_pair / per_token

    def _structural(self, choice: OverlapChoice, tokens, attention):
        """The structure's step time for token and attention counts (scalars or arrays)."""
        scaled_tokens, scaled_attention = tokens * _TOKEN_SCALE, attention * _ATTENTION_SCALE
        c, m = self.compute.coef, self.comm.coef
        compute = np.maximum(c[0] + c[1] * scaled_tokens + c[2] * scaled_attention, 0.0)
        comm = np.maximum(m[0] + m[1] * scaled_tokens, 0.0)
        k = choice.num_ubatches
        if k == 1:
            return compute + comm
        s = self.split[k].coef
        compute_k = compute + np.maximum(s[0] + s[1] * scaled_tokens, 0.0) + self.switch_s[k]
        comm_k = comm + (k - 1) * max(m[0], 0.0)
        return np.maximum(compute_k, comm_k) + np.minimum(compute_k, comm_k) / k

    def structural(self, choice: OverlapChoice, shape: StepShape) -> float:
        return float(self._structural(choice, float(shape.num_tokens), float(shape.attention)))

    def _median_ratio(self, choice: OverlapChoice, recent) -> float | None:
        if not recent:
            return None
        tokens, attention, step_s = np.asarray(recent, dtype=float).T
        structural = self._structural(choice, tokens, attention)
        valid = structural > 0
        if not valid.any():
            return None
        return float(np.median(np.clip(step_s[valid] / structural[valid], 1 / 3, 3.0)))

    def correction(self, choice: OverlapChoice, bucket: tuple[bool, int]) -> float:
        """Median measured / structural over the choice's recent steps in `bucket`, pulled
        toward the median over all its recent steps while the bucket has few (one early
        outlier must not condemn a choice the planner then never runs there), else 1.

        Cached: a (choice, bucket) entry is re-priced when that bucket gets a step, and all
        entries every `REPRICE_EVERY` steps (the fit moves slowly; the planner runs every step)."""
        key = (choice.name, bucket)
        if key not in self._corrections:
            if choice.name not in self._overall:
                self._overall[choice.name] = self._median_ratio(choice, self._recent[choice.name])
            overall = self._overall[choice.name]
            in_bucket = self._recent_in_bucket.get(key, ())
            local = self._median_ratio(choice, in_bucket) if overall is not None else None
            if overall is None:
                value = 1.0
            elif local is None:
                value = overall
            else:
                weight = len(in_bucket) / (len(in_bucket) + SHRINK_STEPS)
                value = weight * local + (1 - weight) * overall
            self._corrections[key] = value
        return self._corrections[key]

    def predict(self, choice: OverlapChoice, shape: StepShape) -> float:
        return self.structural(choice, shape) * self.correction(choice, shape.bucket)

    def observe(self, choice: OverlapChoice, shape: StepShape, measured: StepMeasurement) -> None:
        k = choice.num_ubatches
        self.price.update(self._compute_features(shape), measured.compute_s + measured.switch_s)
        if k == 1:
            self.compute.update(self._compute_features(shape), measured.compute_s + measured.switch_s)
            if not choice.sbo:  # SBO hides part of the transfers; the link's cost is what no overlap shows
                self.comm.update(self._comm_features(shape), measured.comm_s)
        elif self.compute.count:
            unsplit = self.compute.predict(self._compute_features(shape))
            self.split[k].update(self._comm_features(shape), measured.compute_s - unsplit)
            self.switch_s[k] += 0.2 * (measured.switch_s - self.switch_s[k])
        self._observed += 1
        if self._observed % REPRICE_EVERY == 0:
            self._corrections.clear()
            self._overall.clear()
        self._corrections.pop((choice.name, shape.bucket), None)
        sample = (shape.num_tokens, shape.attention, measured.step_s)
        self._recent[choice.name].append(sample)
        self._recent_in_bucket.setdefault((choice.name, shape.bucket), deque(maxlen=CORRECTION_WINDOW)).append(sample)


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
        """Predicted step seconds per choice (inf where nothing is known yet)."""
        if self.model.ready:
            return [self.model.predict(c, shape) for c in self.choices]
        if self.prior is not None:
            return [self.prior.predict(c, shape) for c in self.choices]
        return [math.inf] * len(self.choices)

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
