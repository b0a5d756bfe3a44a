"""Benchmarks behind `tandem bench` and `tandem tune`: step-time sweeps of a model step (or
of a synthetic MoE layer stack) on N local ranks, over token counts and overlap modes, with
the floor max(compute, communication) and the runtime's time model measured in the same run.

- `workloads`: what one rank runs (`ModelStepWorkload`, `MoEStackWorkload`), over `moe_stack`
  (the synthetic `MoEStack`) and `modes` (the overlap modes compared and their settings);
- `sweep`: the measurement loop on every rank, fabric calibration, the launch;
- `report`: rows, the table, JSON and the PNG plot;
- `tune`: picking DBO token thresholds from a sweep.
"""

from tandem.bench.report import rows_from_sweep, write_json, write_plot
from tandem.bench.sweep import BenchSpec, run_sweep
from tandem.bench.tune import choose_threshold

__all__ = ["BenchSpec", "choose_threshold", "rows_from_sweep", "run_sweep", "write_json", "write_plot"]
