"""The overlap planner's cost model: one rank's step time per way to run a step, fitted
online to the runtime's own time model (`StepTimes`, read as `StepMeasurement`):

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

The planner that asks it, and what it does before the fit has data, is
`tandem.ubatch.planner`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

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

    def measured(self, choice: OverlapChoice) -> bool:
        """Whether a recent step ran `choice`."""
        return bool(self._recent[choice.name])

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

