"""`SchedulerConfig`: what the scheduler admits into a step (requests, context length,
compiled grammars), whether the loop overlaps steps, and how long a step may take."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.options import option


@dataclass
class SchedulerConfig:
    """What the scheduler admits into a step, and how long a step may take."""

    max_num_seqs: int = option(64, "Most requests running at once per rank.")
    #: None: the model's own context length (the front end also caps it at one rank's KV cache).
    max_model_len: int | None = option(
        None,
        "Longest context (prompt + max_tokens) a request may use (default: the model's, capped by the KV cache); "
        "the front end and the ranks both refuse longer requests.",
    )
    #: None: on where it pays (`overlaps_schedule`).
    overlap_schedule: bool | None = option(
        None,
        "Overlap the CPU work of step N-1 (results, stop checks, scheduling) with the forward of step N; "
        "--disable-overlap-schedule runs them in sequence. Default: on, except on a CPU whose cores all "
        "run the forward (the overlapped work would take a core from it).",
        flag="--overlap-schedule/--disable-overlap-schedule",
    )
    #: 512 MB: vLLM's bound for the same cache.
    grammar_cache_mb: int = option(
        512,
        "Compiled grammars (response_format json_schema, tools) each rank keeps, in MB; the least recently used go "
        "first. A client that sends a new schema per call would otherwise grow the rank for good.",
    )
    step_timeout_s: float = option(
        300.0,
        "Seconds a rank may spend in one step before it is declared stuck and the engine unavailable "
        "(503); keep it well above the slowest normal step.",
        flag="--step-timeout",
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.grammar_cache_mb < 1:
            raise ValueError(f"--grammar-cache-mb must be >= 1, got {self.grammar_cache_mb}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"--step-timeout must be > 0, got {self.step_timeout_s}")

    def overlaps_schedule(self, device_type: str, forward_threads: int, cores: int) -> bool:
        """Whether the loop overlaps step N-1's CPU work with step N's forward. On the CPU the
        forward is the CPU: the overlapped work runs in a second thread and, when the forward's
        threads hold every core, stalls them at each parallel region's barrier (one rank on 2
        cores decoded at 15.6 ms/token overlapped against 11.6 ms in sequence)."""
        if self.overlap_schedule is not None:
            return self.overlap_schedule
        return device_type != "cpu" or forward_threads < cores

    def context_length(self, model_max_len: int) -> int:
        """The longest context a request may use: `--max-model-len`, or the model's own; the one
        place it is checked against the model. The front end also caps it by the KV cache
        (`CacheConfig.usable_tokens`)."""
        if self.max_model_len is None:
            return model_max_len
        if self.max_model_len > model_max_len:
            raise ValueError(f"--max-model-len {self.max_model_len} is over the model's context length {model_max_len}")
        return self.max_model_len
