"""The least-squares line the host profile puts through its measured points (`simulate.host_link`:
gloo's transfers; `simulate.host_elementwise`: the non-GEMM ops): intercept = fixed cost per
call, slope = cost per unit."""

from __future__ import annotations


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


__all__ = ["fit_line"]
