"""`here` profiles with given figures instead of measured ones, so a test's arithmetic is exact
(the simulator tests of #31): a host whose 1024-wide float32 matmul runs at 100 GFLOP/s and
copies and reads at 20 GB/s. Unless a test gives them, its weights cost nothing extra cold,
its gloo transfers move bytes at the copy rate with no fixed cost per call, and it has no
measured elementwise lines (the norm passes at the sum's bandwidth price the non-GEMM work)
nor fused experts kernel (the GEMM curve prices every model's experts)."""

from __future__ import annotations

import math

from tandem.bench.roofline import Roofline
from tandem.simulate.host import host_profile
from tandem.simulate.host_elementwise import ElementwiseFit
from tandem.simulate.host_experts import FusedExpertsFit
from tandem.simulate.host_link import LinkFit

ROOFLINE = Roofline("cpu", "float32", 20e9, 20e9, 100e9, 2**26, 1024)


def given_host(ranks: int = 2, *, small_rate: float, switch_s: float, cold_rate: float = math.inf,
               link: LinkFit | None = None, elementwise: ElementwiseFit | None = None,
               experts: FusedExpertsFit | None = None):
    """`host_profile` on `ROOFLINE` with every other figure given."""
    return host_profile(ranks, roofline=ROOFLINE, small_rate=small_rate, switch_s=switch_s, cold_rate=cold_rate,
                        link=link or LinkFit.copies(ROOFLINE.bandwidth_bytes_per_s),
                        elementwise=elementwise or ElementwiseFit.unmeasured(), experts=experts or FusedExpertsFit.unmeasured())
