"""`tandem simulate`: what each overlap mode buys on a cluster you don't have.

The op model reads the model the way the runtime does (`model_shape`), the schedules are the
runtime's own (`schedule`: the layers' operation lists, the kernel's DBO hand-overs, the stage
executor, `tandem.ubatch`'s cut), the hardware is a data file of public figures
(`hardware/*.json`). See docs/simulate.md for the validation against DeepSeek's published profile.
"""

from tandem.simulate.hardware import PROFILES, HardwareProfile, load_hardware
from tandem.simulate.model_shape import PRESETS, ModelShape, model_shape
from tandem.simulate.report import format_table, format_validation, validation_rows
from tandem.simulate.run import ModeResult, Simulation, Workload, simulate
from tandem.simulate.trace import write_timelines, write_trace

__all__ = [
    "PRESETS", "PROFILES", "HardwareProfile", "ModeResult", "ModelShape", "Simulation", "Workload",
    "format_table", "format_validation", "load_hardware", "model_shape", "simulate", "validation_rows",
    "write_timelines", "write_trace",
]  # fmt: skip
