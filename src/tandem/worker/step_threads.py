"""How many CPU threads a step runs on, chosen from the steps' own times.

On a CPU the rank's threads share the cores with the front end and the clients. A small
model's step gains little from a second thread and loses whenever a core is busy elsewhere
(the team waits at every barrier for a thread the OS parked), while a large model's step
gains nearly 2x: on a 2-core machine, one thread per rank served a tiny Mixtral 8-14 % faster
at 1 and 32 streams, and the hidden-1024 Qwen3-MoE 15-20 % slower at 1 and 8 streams
(`benchmarks/vs_vllm.py`). No rule of thumb covers both, so each kind of decode step (by
size) times its forwards with one thread and with all the rank's threads, keeps the faster,
and times both again every `recheck_every` steps of that kind, as load changes.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import time
from typing import Iterator

import torch

StepKind = tuple[bool, int]


def step_kind(decode_only: bool, num_tokens: int) -> StepKind:
    """Decode or not, and the token count rounded up to a power of 2."""
    return decode_only, 1 << (max(num_tokens, 1) - 1).bit_length()


class StepThreads:
    """The thread count of each step kind: `trial_steps` timed forwards of each choice,
    alternating (the two see the same load and batch), then the faster by median; both are
    timed again, alternating, every `recheck_every` steps of that kind."""

    def __init__(self, most: int, *, trial_steps: int = 4, recheck_every: int = 500):
        self.choices = (1, most) if most > 1 else (max(most, 1),)
        self.trial_steps, self.recheck_every = trial_steps, recheck_every
        self._times: dict[StepKind, dict[int, list[float]]] = {}
        self._since_trial: collections.Counter = collections.Counter()
        self._current = self.baseline = torch.get_num_threads()
        #: Steps run with each thread count (what the policy chose, for the counters).
        self.steps_by_threads: collections.Counter = collections.Counter()

    def pick(self, kind: StepKind) -> int:
        if len(self.choices) == 1 or not kind[0]:
            # Steps with prefill run on every thread: their sizes vary too much within a kind
            # for a few trials to compare (on the hidden-1024 model, timing them too lost
            # 17-21 % at 8 and 32 streams), and compute-bound work gains from each thread.
            return self.choices[-1]
        times = self._times.setdefault(kind, {c: [] for c in self.choices})
        fewest = min(len(t) for t in times.values())
        if fewest < self.trial_steps:  # trials: the choice with fewer samples, the other on a tie
            short = [c for c in self.choices if len(times[c]) == fewest]
            return next((c for c in short if c != self._current), short[0])
        best = min(self.choices, key=lambda c: statistics.median(times[c]))
        self._since_trial[kind] += 1
        if self._since_trial[kind] >= self.recheck_every:  # this step is the first trial
            self._since_trial[kind] = 0
            for samples in times.values():
                samples.clear()
        return best

    def observe(self, kind: StepKind, threads: int, seconds: float) -> None:
        samples = self._times.get(kind, {}).get(threads)  # None for an untimed kind
        if samples is not None and len(samples) < self.trial_steps:
            samples.append(seconds)

    def restore(self) -> None:
        """Give the process back the thread count it had: the choice is the steps' alone (a
        runner built next in the same process would otherwise start from one thread, and its
        engine's overlap default with it)."""
        if self._current != self.baseline:
            torch.set_num_threads(self.baseline)
            self._current = self.baseline

    @contextlib.contextmanager
    def running(self, decode_only: bool, num_tokens: int) -> Iterator[None]:
        """Run the body (one forward of this kind of step) on the chosen thread count and time it."""
        kind = step_kind(decode_only, num_tokens)
        threads = self.pick(kind)
        if threads != self._current:
            torch.set_num_threads(threads)
            self._current = threads
        self.steps_by_threads[threads] += 1
        start = time.perf_counter()
        yield
        self.observe(kind, threads, time.perf_counter() - start)


def step_threads_for(mode: str, device: torch.device, *, compiled: bool = False) -> StepThreads | None:
    """`--cpu-threads auto`: the policy on a CPU rank with more than one thread; None
    otherwise (`fixed`, a GPU, one thread: nothing to choose; a runner built by hand, with
    no config, is fixed) and for a compiled step, whose graphs inductor specialised to the
    thread count it compiled with (a hidden-1024 bfloat16 decode step took 3x as long on
    changing counts)."""
    if mode == "fixed" or compiled or device.type != "cpu" or torch.get_num_threads() < 2:
        return None
    return StepThreads(torch.get_num_threads())


__all__ = ["StepThreads", "step_kind", "step_threads_for"]
