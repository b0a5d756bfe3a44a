"""The least-squares line the host profile puts through its measured points (`simulate.host_link`:
gloo's transfers; `simulate.host_elementwise`: the non-GEMM ops): intercept = fixed cost per
call, slope = cost per unit. `fit_line` is also the soak's (`testing.soak`: the warm-up's line
and the RSS trend). A slope that is not positive (the points did not resolve a cost per
unit, e.g. under load) is kept as an infinite rate, priced as free, and said so: `unresolved`
names those kinds and `UNRESOLVED` is the note a figure's source carries for them."""

from __future__ import annotations

import math

#: What a figure's source says of a kind whose measured points gave a slope <= 0.
UNRESOLVED = "not resolved: slope <= 0 at these points, priced as free"


def fit_line(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y against x."""
    n = len(pairs)
    if n == 0:
        return 0.0, 0.0
    mx, my = sum(x for x, _ in pairs) / n, sum(y for _, y in pairs) / n
    sxx = sum((x - mx) ** 2 for x, _ in pairs)
    if sxx == 0:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in pairs) / sxx
    return my - slope * mx, slope


def fit_rates(points: dict[str, list[tuple[float, float]]]) -> tuple[dict[str, float], dict[str, float]]:
    """Per kind: (seconds fixed per call, units per second) of the line through its (units,
    seconds) points. The fixed part is never below 0; a slope <= 0 gives an infinite rate (see
    `unresolved`)."""
    fixed, rates = {}, {}
    for kind, pairs in points.items():
        intercept, slope = fit_line(pairs)
        fixed[kind], rates[kind] = max(intercept, 0.0), 1.0 / slope if slope > 0 else math.inf
    return fixed, rates


def unresolved(points: dict[str, list[tuple[float, float]]]) -> list[str]:
    """The kinds whose measured points give a slope <= 0 (priced as free)."""
    return [kind for kind, pairs in points.items() if pairs and fit_line(pairs)[1] <= 0]


__all__ = ["UNRESOLVED", "fit_line", "fit_rates", "unresolved"]
