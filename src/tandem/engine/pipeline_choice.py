"""The start-up choice of a pipeline's first stage: the configured micro-batch ring, or one
micro-batch in flight, whichever decodes faster here."""

from __future__ import annotations

import math
import time

import torch

from tandem.engine.pipeline import PipelineEngine, StageCounters
from tandem.platform.device import available_cores
from tandem.worker.sampling import SamplingParams


def _decode_burst_s(engine: PipelineEngine, tag: str, num_requests: int, decode_tokens: int) -> float:
    """Seconds for `num_requests` short prompts to decode `decode_tokens` tokens each."""
    params = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"__{tag}_{i}__", [1, 2, 3, 4], params)
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    return time.perf_counter() - start


def choose_micro_batches(engine: PipelineEngine, num_requests: int, decode_tokens: int = 8) -> str:
    """Measure, on a short decode burst of `num_requests` requests, the configured ring
    (M micro-batches in flight) against one micro-batch in flight (the stages take turns);
    keep the faster and return the reason in words.

    M micro-batches pay only when a step's cost grows with its size: the busiest stage runs
    M steps of N/M requests per round where one process runs one step of N. On a small model
    a step costs about the same whatever its size (Python and kernel launches, not
    arithmetic), so splitting multiplies that cost by M and the ring loses to one process;
    one micro-batch in flight then costs only the transfers. Run on the first stage of a
    pipeline without DP (DP peers would have to agree on the choice), before serving."""
    configured = engine.num_micro_batches
    if configured == 1:
        return "one micro-batch in flight (configured)"
    num_requests = max(1, min(num_requests, engine.scheduler.max_num_seqs))
    timings = {}
    engine.probing = True
    try:
        for trial, micro_batches in enumerate((configured, 1, configured, 1)):
            engine.num_micro_batches = micro_batches
            seconds = _decode_burst_s(engine, f"probe{trial}", num_requests, decode_tokens)
            timings[micro_batches] = min(timings.get(micro_batches, math.inf), seconds)
    finally:
        engine.probing = False
    rate = {m: num_requests * decode_tokens / s for m, s in timings.items()}
    measured = (f"{num_requests} decode streams at start-up: {configured} micro-batches in flight "
                f"{rate[configured]:.0f} tok/s, one in flight {rate[1]:.0f} tok/s")
    engine.worker.counters = StageCounters()  # the probe is no serving work
    if rate[1] > rate[configured]:
        engine.num_micro_batches = 1
        return (f"pipeline parallelism will not pay for this model here ({measured}): a step costs about the same "
                f"whatever its size, so splitting the batch over {configured} micro-batches loses; serving with one "
                "micro-batch in flight (serve without --pipeline-parallel-size to save the transfers)")
    engine.num_micro_batches = configured
    return f"pipeline parallelism pays ({measured}): serving with {configured} micro-batches in flight"



def pipeline_verdict(engine: PipelineEngine, max_num_seqs: int) -> str:
    """Whether this pipeline can beat one process on decode, in one start-up line; when the
    configured micro-batch ring measures slower than one micro-batch in flight, the engine
    keeps one in flight."""
    from tandem.distributed.launch import local_world_size

    topology = engine.worker.topology
    if engine.worker.device.type == "cpu":
        cores = available_cores()
        here = local_world_size(topology.world_size)  # under torchrun, the other hosts' ranks have their own
        wanted = here * torch.get_num_threads()
        if wanted > cores:
            return (f"pipeline parallelism will not pay here: this host's {here} rank processes x "
                    f"{torch.get_num_threads()} threads need {wanted} CPU cores and it has {cores} (the stages "
                    "would take turns on the cores instead of running side by side)")
    if topology.data_parallel_size > 1:
        return (f"pipeline parallelism: {engine.num_micro_batches} micro-batches in flight (not measured at start-up "
                "with data parallelism: the first stage's DP ranks would have to agree on the choice)")
    return choose_micro_batches(engine, max_num_seqs)


__all__ = ["choose_micro_batches", "pipeline_verdict"]
