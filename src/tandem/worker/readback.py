"""What a step hands back to the host: the prompt log-probabilities some chunks ask for
(gathered on the device, `prompt_logprob_rows`) and the step's one host read of them and of
the samples (`read_samples`), trimmed to what each request asked for. `ModelRunner` calls
both once per step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from tandem.platform.device import host_buffer, to_device_async
from tandem.worker.sampling import SampleOutput, SamplingParams, token_logprobs
from tandem.worker.step_inputs import StepInputs


@dataclass
class PromptLogprobRows:
    """A step's prompt log-probabilities on the device: `values`/`ids` `[P, 1 + K]`, the rows
    of request `owners[i]` next to each other, `counts[i]` of them."""

    owners: list[int]
    counts: list[int]
    values: torch.Tensor
    ids: torch.Tensor


def prompt_logprob_rows(model, hidden, inputs: StepInputs, chunks, sampling) -> PromptLogprobRows | None:
    """The log-probabilities of the prompt tokens the chunks ask for (`ScheduledChunk.
    prompt_targets`), from the hidden states of the rows that prefill them, on the device."""
    owners = [r for r, c in enumerate(chunks) if c.prompt_targets]
    if not owners:
        return None
    starts = [0, *itertools.accumulate(inputs.num_scheduled_tokens)]
    rows: list[int] = []
    targets: list[int] = []
    for r in owners:
        first = starts[r] + chunks[r].prompt_targets_row
        rows += range(first, first + len(chunks[r].prompt_targets))
        targets += chunks[r].prompt_targets
    logits = model.compute_logits(hidden[to_device_async(torch.tensor(rows), hidden.device)])
    top = max(sampling[r].prompt_logprobs or 0 for r in owners)
    values, ids = token_logprobs(logits, to_device_async(torch.tensor(targets), hidden.device), top)
    return PromptLogprobRows(owners, [len(chunks[r].prompt_targets) for r in owners], values, ids)


def read_samples(platform, sampled: SampleOutput, params: Sequence[SamplingParams],
                 prompt: PromptLogprobRows | None = None, sampling: Sequence[SamplingParams] = ()):
    """The step's one host read: the sampled ids, and the log-probabilities some request
    asked for (of its samples, of its prompt), copied without blocking into page-locked
    memory behind one event of `platform` (the overlapped loop's scheduler thread runs
    meanwhile). Returns (ids, per sampled row [(id, logprob), ...] trimmed to its `logprobs`
    or None, per `prompt.owners` entry its targets' lists trimmed to its `prompt_logprobs` or
    None)."""
    tensors = [sampled.tokens]
    if sampled.logprobs is not None:
        tensors += [sampled.logprobs, sampled.logprob_ids]
    if prompt is not None:
        tensors += [prompt.values, prompt.ids]
    hosts = [host_buffer(t) for t in tensors]
    for host, tensor in zip(hosts, tensors):
        host.copy_(tensor, non_blocking=True)
    copied = platform.new_event()
    copied.record()
    copied.synchronize()
    tokens = hosts[0].tolist()
    logprobs = None
    if sampled.logprobs is not None:
        rows = zip(hosts[2].tolist(), hosts[1].tolist(), params)
        logprobs = [None if p.logprobs is None else list(zip(ids, lps))[: 1 + p.logprobs] for ids, lps, p in rows]
    prompt_logprobs = None
    if prompt is not None:
        entries = [list(zip(ids, lps)) for ids, lps in zip(hosts[-1].tolist(), hosts[-2].tolist())]
        bounds = [0, *itertools.accumulate(prompt.counts)]
        prompt_logprobs = [
            [entry[: 1 + (sampling[r].prompt_logprobs or 0)] for entry in entries[lo:hi]]
            for r, lo, hi in zip(prompt.owners, bounds, bounds[1:])
        ]
    return tokens, logprobs, prompt_logprobs


__all__ = ["PromptLogprobRows", "prompt_logprob_rows", "read_samples"]
