"""`OverlapConfig`: when and how a step is split into ubatches (DBO / TBO), and the overlap
planner's policy."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.config.options import option

EXECUTORS = ("thread", "greenlet", "stages")
GRAPH_MODES = ("auto", "none", "full")
#: `static`: the two token thresholds decide; `auto`: the overlap planner (tandem.ubatch.planner).
OVERLAP_POLICIES = ("static", "auto")
#: Where a DBO step is cut: at the token midpoint, or where the ubatches' predicted costs match.
UBATCH_SPLITS = ("tokens", "balanced-cost")
#: What `auto` starts from without a thresholds file: the simulator's prediction, or nothing.
OVERLAP_PRIORS = ("simulate", "none")


@dataclass
class OverlapConfig:
    """When and how a step is split into ubatches (DBO)."""

    enable_dbo: bool = option(False, "Split large steps into ubatches that overlap communication.")
    #: SGLang's spelling of DBO with the stages executor; kept as its own switch so a
    #: contradicting --ubatch-executor is an error rather than silently overridden.
    enable_two_batch_overlap: bool = option(
        False, "SGLang's name for two-batch overlap: the same as --enable-dbo --ubatch-executor stages."
    )
    num_ubatches: int = option(2, "Ubatches per DBO step.")
    executor: str = option(
        "thread", "thread | greenlet | stages (TBO: operation lists, no threads)", flag="--ubatch-executor"
    )
    tbo_token_distribution_threshold: float = option(
        0.48, "TBO prefill split: cut inside a sequence when no sequence boundary gives each ubatch this share."
    )
    dbo_decode_token_threshold: int = option(32, "Smallest uniform-decode step that uses DBO.")
    dbo_prefill_token_threshold: int = option(512, "Smallest other step that uses DBO.")
    #: The `tandem tune` file the thresholds came from; `auto` starts from its sweep.
    thresholds_file: str | None = option(
        None, "JSON from `tandem tune`; overrides the two thresholds (static) or seeds the planner (auto)."
    )
    overlap_policy: str = option(
        "static",
        "static (the two token thresholds decide) | auto (per step, the fastest of no overlap, SBO and DBO with "
        "2..N ubatches as predicted by a cost model fitted to the measured step times; needs --enable-dbo for DBO).",
    )
    overlap_prior: str = option(
        "simulate",
        "What --overlap-policy auto (with --enable-dbo) starts from without --thresholds-file: simulate (the "
        "simulator's none / DBO steps for the served model, computed once at start-up: on the CPU this host measured "
        "with its gloo ranks, on CUDA the built-in profile of the GPU) | none (nothing: the static thresholds until "
        "the planner has measured).",
    )
    ubatch_split: str = option(
        "tokens", "tokens (cut at the token midpoint) | balanced-cost (equal predicted work: attention + MoE tokens)."
    )
    graph_mode: str = option("auto", "auto | none | full (decode replayed from graphs captured at start-up; "
                             "auto: full on CUDA when the MoE backends can be captured and the step is not compiled)")
    comm_sms: int | None = option(
        None, "GPU SMs reserved for DeepEP while ubatches overlap (even); DeepGEMM gets the rest."
    )
    #: Share of steps the planner runs a choice other than its best (at most 0.05).
    planner_explore_share: float = 0.03
    #: The `tandem tune` document `auto` starts from when no thresholds file is given: the
    #: simulated prior the command computed once (`--overlap-prior simulate`), carried in the
    #: config so every rank gets the same one.
    simulated_prior: dict | None = None

    def __post_init__(self) -> None:
        if self.enable_two_batch_overlap:
            if self.executor not in ("thread", "stages"):  # "thread" is the default: not a choice
                raise ValueError(
                    f"--enable-two-batch-overlap runs the stages executor; it contradicts --ubatch-executor {self.executor}"
                )
            self.enable_dbo, self.executor = True, "stages"
        if self.comm_sms is not None and (self.comm_sms < 2 or self.comm_sms % 2):
            raise ValueError(f"--comm-sms must be an even count >= 2 (DeepEP uses SMs in pairs), got {self.comm_sms}")
        if self.num_ubatches < 2:
            raise ValueError(f"--num-ubatches must be >= 2, got {self.num_ubatches}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"--ubatch-executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"--graph-mode must be one of {GRAPH_MODES}, got {self.graph_mode!r}")
        if not 0.0 <= self.tbo_token_distribution_threshold <= 0.5:
            raise ValueError(
                f"--tbo-token-distribution-threshold must lie in [0, 0.5], got {self.tbo_token_distribution_threshold}"
            )
        if self.overlap_policy not in OVERLAP_POLICIES:
            raise ValueError(f"--overlap-policy must be one of {OVERLAP_POLICIES}, got {self.overlap_policy!r}")
        if self.overlap_prior not in OVERLAP_PRIORS:
            raise ValueError(f"--overlap-prior must be one of {OVERLAP_PRIORS}, got {self.overlap_prior!r}")
        if self.ubatch_split not in UBATCH_SPLITS:
            raise ValueError(f"--ubatch-split must be one of {UBATCH_SPLITS}, got {self.ubatch_split!r}")
        if not 0.0 <= self.planner_explore_share <= 0.05:
            raise ValueError(f"planner_explore_share must lie in [0, 0.05], got {self.planner_explore_share}")
        for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")

    @property
    def greenlet_ubatches(self) -> bool:
        """DBO on greenlets, whose switch cannot cross C++ frames (the compiled step's ops)."""
        return self.enable_dbo and self.executor == "greenlet"

    def with_thresholds_file(self, path: str | Path | None) -> "OverlapConfig":
        """Thresholds from a `tandem tune` file (JSON with `dbo_decode_token_threshold` and
        `dbo_prefill_token_threshold`) override the flags."""
        if path is None:
            return self
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"thresholds file {path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"thresholds file {path} is not valid JSON: {exc}") from None
        keys = ("dbo_decode_token_threshold", "dbo_prefill_token_threshold")
        missing = [k for k in keys if not isinstance(data.get(k), int)]
        if missing:
            raise ValueError(f"thresholds file {path} lacks integer {', '.join(missing)}")
        return OverlapConfig(**{**asdict(self), **{k: data[k] for k in keys}, "thresholds_file": str(path)})
