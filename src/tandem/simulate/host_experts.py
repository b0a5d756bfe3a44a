"""The runtime's fused CPU experts as `here` prices them.

A model step on the CPU runs each MoE layer's routed experts in one call of tandem's kernel
(`cpu_gemm.fused_experts`, the op `tandem::cpu_moe`): it streams every active expert's packed
weights once and computes its rows in registers. That is not a GEMM per expert at the host's
GEMM curve plus a cold read of each weight, which is how `OpCosts` prices experts otherwise:
on small-moe decode (one rank, 64 requests) the curve put the second half of a split batch at
42 ms where the step measured 16. The bench's MoE stack passes plain tensors, not parameters,
so its experts take torch's path (a GEMM per expert) and keep the curve; so do
`sbo-combine-down-gemm`'s blocks (`TorchExperts.apply_blocks`).

`measure_fused_experts` times the kernel at small-moe's layer on 2 ranks (8 local experts,
hidden 1024, expert intermediate 512, top-2, float32), the weights of 4 layers cycled so each
call reads its weights from memory as a step does, at a few token counts, in one process (the
cold GEMM reads are measured on every rank at once; two ranks streaming at once share the
memory bandwidth, so this weight rate is likely optimistic for a 2-rank step, which the
real-link predictions' per-job CPU scale absorbs only on average); the line through
them gives a time per call fixed in the tokens (streaming the experts' weights: weight bytes per
second) and a time per token (its rows' arithmetic and the kernel's per-row work: FLOP/s). Any
other expert shape is priced at those two rates.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from tandem.simulate.line_fit import fit_line

#: The measured layer: small-moe's experts on each of 2 ranks.
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 1024, 512, 8, 2
#: Tokens per call: every expert active at each (64+ rows over 8 experts).
TOKENS = (32, 128, 512)
#: Layers whose weights the calls cycle over (192 MB at the measured shape: past the last-level cache).
LAYERS = 4
WEIGHT_FIGURE, FLOPS_FIGURE = "fused_experts_weight_bytes_per_s", "fused_experts_flops"


def weight_bytes(experts: float, hidden: int, intermediate: int, element: float) -> float:
    """Bytes of `experts` experts' gate, up and down weights."""
    return experts * 3 * hidden * intermediate * element


def row_flops(rows: float, hidden: int, intermediate: int) -> float:
    """FLOPs of `rows` expert rows through gate, up and down."""
    return rows * 6.0 * hidden * intermediate


@dataclass(frozen=True)
class FusedExpertsFit:
    """The kernel's two rates, and the (tokens, seconds) points they come from."""

    weight_bytes_per_s: float
    flops_per_s: float
    points: tuple[tuple[int, float], ...] = ()
    #: False: nothing was measured (`unmeasured`), the profile gets no figure and the GEMM curve prices experts.
    measured: bool = True

    @classmethod
    def unmeasured(cls) -> FusedExpertsFit:
        return cls(math.inf, math.inf, (), False)

    @classmethod
    def from_points(cls, points: list[tuple[int, float]]) -> FusedExpertsFit:
        fixed, per_token = fit_line(points)
        weights = weight_bytes(EXPERTS, HIDDEN, INTERMEDIATE, 4)
        return cls(weights / fixed if fixed > 0 else math.inf,
                   row_flops(TOP_K, HIDDEN, INTERMEDIATE) / per_token if per_token > 0 else math.inf, tuple(points))

    @classmethod
    def from_figures(cls, figures: dict) -> FusedExpertsFit | None:
        """The fit a profile holds, or None (a profile that did not measure the kernel)."""
        if WEIGHT_FIGURE not in figures:
            return None
        return cls(float(figures[WEIGHT_FIGURE]), float(figures[FLOPS_FIGURE]))

    def time(self, *, tokens: float, top_k: int, local_experts: int, hidden: int, intermediate: int, element: float) -> float:
        """One layer's experts for `tokens` tokens, a rank receiving tokens x `top_k` rows spread
        evenly over its `local_experts` (balanced routing; an expert with no row is not read). The
        rows are taken as independent draws, though a token's top-k experts are distinct: at one
        token and top-2 over 8 experts that reads 1.875 experts' weights, not 2; from a few
        tokens on, every expert is active either way."""
        rows = tokens * top_k
        active = local_experts * (1.0 - (1.0 - 1.0 / local_experts) ** rows)
        return (weight_bytes(active, hidden, intermediate, element) / self.weight_bytes_per_s
                + row_flops(rows, hidden, intermediate) / self.flops_per_s)

    def figures(self) -> dict[str, tuple[float, str]]:
        if not self.measured:
            return {}
        pts = ", ".join(f"{t} tokens {s * 1e3:.2f} ms" for t, s in self.points)
        how = (f"measured in this run: tandem's fused CPU experts (tandem::cpu_moe), {EXPERTS} experts of hidden {HIDDEN} "
               f"and intermediate {INTERMEDIATE}, top-{TOP_K}, float32, weights of {LAYERS} layers cycled, median a call; "
               f"the line through ({pts})")
        return {WEIGHT_FIGURE: (self.weight_bytes_per_s, f"{how}: every expert's weights over its intercept"),
                FLOPS_FIGURE: (self.flops_per_s, f"{how}: a token's rows' FLOPs over its slope")}


def measure_fused_experts(repeat: int = 5) -> FusedExpertsFit:
    """The kernel's line on this host (see the module docstring); `FusedExpertsFit.unmeasured()`
    where tandem's CPU kernels are not built here (the runtime then takes torch's path, which
    the curve prices)."""
    from tandem.platform import cpu_kernels

    if not cpu_kernels.available():
        return FusedExpertsFit.unmeasured()
    g = torch.Generator().manual_seed(0)
    layers = [(cpu_kernels.pack(torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) * HIDDEN**-0.5),
               cpu_kernels.pack(torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=g) * INTERMEDIATE**-0.5))
              for _ in range(LAYERS)]
    calls = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, generator=g)
        ids = torch.rand(tokens, EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K]
        calls[tokens] = (x, ids, torch.full((tokens, TOP_K), 1.0 / TOP_K))
    seconds: dict[int, list[float]] = {t: [] for t in TOKENS}
    for round_ in range(repeat + 1):  # the first round pages the weights in
        for tokens, (x, ids, weights) in calls.items():
            for w13, w2 in layers:
                start = time.perf_counter()
                cpu_kernels.moe(x, ids, weights, w13, w2, INTERMEDIATE)
                if round_:
                    seconds[tokens].append(time.perf_counter() - start)
    return FusedExpertsFit.from_points([(t, statistics.median(s)) for t, s in seconds.items()])


__all__ = ["FLOPS_FIGURE", "FusedExpertsFit", "WEIGHT_FIGURE", "measure_fused_experts", "row_flops", "weight_bytes"]
