"""`ModelRunner`: one step of one rank — plan it (agree with the other DP ranks on the
padding and the overlap, cut the ubatches: a `StepPlan`), build the batch, run the model
through the `UBatchWrapper` as the plan says, sample, and feed the measured step back to the
planner.

Every DP rank calls `execute` the same number of times in the same order: the MoE layers'
all-to-alls span all ranks, so a rank with nothing scheduled still runs a dummy batch (all
padding) whenever any other rank has work.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from tandem.config import OverlapConfig
from tandem.contexts import StepTimes, measure_step, set_forward_context
from tandem.models.base import ModelInfo
from tandem.models.paged_attention import NULL_BLOCK
from tandem.models.compiled import CompiledModel
from tandem.worker.step_inputs import ScheduledChunk, StepInputs, build_step_inputs
from tandem.worker.future_map import FutureMap
from tandem.worker.kv_cache import BlockAllocator, allocate_kv_caches
from tandem.platform import get_platform
from tandem.platform.device import to_device_async
from tandem.worker.faults import install_from_env
from tandem.worker.readback import PromptLogprobRows, prompt_logprob_rows, read_samples
from tandem.worker.sampling import RequestSampler, SampleOutput, SamplingParams, sample_step
from tandem.worker.step_plan import StepPlan, decide_overlap
from tandem.worker.step_threads import step_threads_for
from tandem.worker.ubatch_wrapper import UBatchWrapper, resolve_graph_mode
from tandem.ubatch import attention_work, balanced_split, split_by_cost, split_by_tokens
from tandem.ubatch.cost_split import DEFAULT_ATTENTION_WEIGHT
from tandem.ubatch.planner import OverlapPlanner, StepShape
from tandem.worker.planner_cache import PlannerCache, observe_step


@dataclass
class StepResult:
    #: Sampled token per request, None where the chunk did not finish the prompt.
    tokens: list[int | None]
    num_tokens: int
    num_tokens_padded: int
    ubatched: bool
    #: Per request that asked for them: (token id, log-probability) of the sampled token, then
    #: of its `logprobs` most likely ones; None elsewhere (and when no request asked).
    logprobs: list[list[tuple[int, float]] | None] | None = None
    #: Per request whose chunk asked for prompt log-probabilities (`ScheduledChunk.
    #: prompt_targets`): per target, [(token id, log-probability)] of it, then of the
    #: `prompt_logprobs` most likely tokens at its place; None elsewhere (and when none asked).
    prompt_logprobs: list[list[list[tuple[int, float]]] | None] | None = None


class ModelRunner:
    def __init__(
        self,
        model_info: ModelInfo,
        *,
        overlap: OverlapConfig | None = None,
        num_kv_blocks: int = 512,
        block_size: int = 16,
        dp_group=None,
        future_map: FutureMap | None = None,
        tracer=None,
        config=None,
    ):
        self.info = model_info
        #: The `EngineConfig` it was built from (`build_runner`), which an `Engine` around it
        #: reads by default; None for a runner built by hand.
        self.config = config
        self.model = model_info.model
        self.overlap = overlap or OverlapConfig()
        self.block_size = block_size
        self.dp_group = dp_group
        #: Where the model lives; everything the runner makes goes there too.
        self.device = next(self.model.parameters()).device
        self.platform = get_platform(self.device)
        self.allocator = BlockAllocator(num_kv_blocks, reserve_null_block=True)
        self.model.bind_kv_cache(allocate_kv_caches(self.model.kv_cache_specs(), num_kv_blocks, block_size, device=self.device))
        #: The compiled step (`--compile`), or None when the model runs eagerly.
        self.compiled = CompiledModel.for_config(self.model, config, self.device)
        self.wrapper = UBatchWrapper(
            self.model,
            num_ubatches=self.overlap.num_ubatches,
            executor=self.overlap.executor,
            graph_mode=resolve_graph_mode(self.overlap.graph_mode, self.device, self.model, compiled=self.compiled is not None),
            max_blocks_per_seq=-(-model_info.max_model_len // block_size),
            platform=self.platform,
            comm_sms=self.overlap.comm_sms,
        )
        self.future_map = future_map
        #: The overlap timeline's recorder (`tandem.contexts.trace.Tracer`), or None.
        self.tracer = tracer
        self.steps = 0
        self.ubatched_steps = 0
        #: Steps that found every DP rank idle (counted in `steps`; nothing ran).
        self.idle_steps = 0
        #: Wall time spent in the model's forward, over the runner's life.
        self.step_time_s = 0.0
        #: The thread count each step runs on (`--cpu-threads`), or None where nothing is chosen.
        self.threads = step_threads_for(getattr(config, "cpu_threads", "fixed"), self.device, compiled=self.compiled is not None)
        #: The time model: the last step's and the running totals.
        self.last_step_times = StepTimes()
        self.total_step_times = StepTimes()
        # Reliability tests only: nothing is installed unless TANDEM_FAULT_INJECT is set.
        self.fault_hooks = install_from_env(self)
        #: Whether the MoE kernels run single-batch overlap: each step's SBO choice unless the
        #: planner picks per step (a benchmark mode swaps it, as it swaps `overlap`).
        self._kernels = [m.kernel for m in self.model.modules() if hasattr(getattr(m, "kernel", None), "enable_sbo")]
        self.sbo = any(k.enable_sbo for k in self._kernels)
        #: Overlap planners by the settings they plan for: whoever swaps `overlap` (bench
        #: modes) gets back the planner, and what it learnt, of each setting.
        self.planners = PlannerCache()

    @property
    def planner(self) -> OverlapPlanner | None:
        """The overlap planner under `--overlap-policy auto`; under `--ubatch-split
        balanced-cost` too, where it only observes (its fit prices attention for the cut)."""
        return self.planners.planner(self.overlap, sbo=self.sbo, moves_tokens=self.moves_tokens)

    @property
    def moves_tokens(self) -> bool:
        """Whether any MoE layer's dispatch and combine move tokens (see `PrepareAndFinalize.
        moves_tokens`); read per step, as a bench may install a modelled fabric after start-up."""
        return any(k.prepare_finalize.moves_tokens for k in self._kernels)

    @property
    def ubatch_yields(self) -> int:
        return self.wrapper.executor.switches

    # -- one step: plan, inputs, forward, observe ------------------------------------------

    def plan_step(self, chunks: Sequence[ScheduledChunk]) -> StepPlan:
        """Agree with the other DP ranks on the step's padded size and overlap choice, and
        cut its ubatches. Collective: every DP rank calls it once per step."""
        counts = [len(c.token_ids) for c in chunks]
        contexts = [c.num_computed for c in chunks]
        num_tokens = sum(counts)
        o = self.overlap
        planner = self.planner
        uniform_decode = bool(counts) and all(n == 1 for n in counts)
        shape = StepShape(num_tokens, attention_work(counts, contexts) if planner else 0, uniform_decode)
        decision, planned, num_ubatches = decide_overlap(
            o, planner, shape, group=self.dp_group, prefills=any(n != 1 for n in counts)
        )
        if num_ubatches > 1 or self.wrapper.graph_mode == "full":
            # Same shape on every rank (one captured size when all decode), ubatches cut alike.
            padded = decision.num_tokens_padded
            padded = padded if decision.any_rank_prefills else self.wrapper.graph_padded(padded)
        elif decision.num_tokens_padded == 0:
            padded = 0  # every rank is idle
        else:
            # Own tokens only; an idle rank runs one padding token to join the collectives.
            padded = max(num_tokens, 1)
        slices = tuple(split_ubatches(counts, contexts, num_ubatches, padded, o, planner)) if num_ubatches > 1 else None
        # TBO's decode strategy (delta 2) and prefill strategy (delta 0) issue their all-to-alls
        # in different orders: decode only if no rank prefills (an idle rank follows the others,
        # as in SGLang).
        tbo_decode = not decision.any_rank_prefills if slices is not None and o.executor == "stages" else None
        learns = planned is not None and num_tokens > 0  # an idle rank's step is all waiting for the others
        return StepPlan(
            num_tokens=num_tokens,
            num_tokens_padded=padded,
            ubatch_slices=slices,
            tbo_decode=tbo_decode,
            sbo=planned.choice.sbo if planned is not None else self.sbo,
            planned=planned if learns else None,
            shape=shape if learns else None,
        )

    def step_inputs(self, chunks: Sequence[ScheduledChunk], plan: StepPlan) -> StepInputs:
        """The step's input ids, positions and attention metadata, padded as `plan` says."""
        return build_step_inputs(chunks, self.block_size, plan.num_tokens_padded, device=self.device)

    def forward(self, x: torch.Tensor, inputs: StepInputs, plan: StepPlan, *, count: bool = True) -> torch.Tensor:
        """Run the model on `x` (the step's input ids, or a pipeline stage's incoming hidden
        states) as `plan` says. `count`: a serving step, which the step counters and the fault
        injection's step index see; False for a start-up measurement."""
        start = time.perf_counter()
        if count:
            self.steps += 1
            self.ubatched_steps += plan.ubatched
        threads = self.threads.running(inputs.attn_metadata.decode_only, x.shape[0]) if count and self.threads else None
        try:
            with set_forward_context(plan.forward_context(inputs.attn_metadata)), threads or contextlib.nullcontext():
                return self.wrapper(x, inputs.positions)
        finally:
            if count:
                self.step_time_s += time.perf_counter() - start

    @property
    def compiles_on_first_use(self) -> bool:
        """Whether the compiled step, decode graphs or a MoE kernel's backend compile on first use."""
        return self.compiled is not None or self.wrapper.graph_mode == "full" or any(
            k.experts.compiles_on_first_use or k.prepare_finalize.compiles_on_first_use for k in self._kernels
        )

    @torch.no_grad()
    def warm_up(self, max_decode_rows: int | None = None) -> None:
        """One unsplit step of one padding token, the dummy an idle rank runs, uncounted.
        Collective: every DP rank calls it at the same point. Library init and kernel JIT
        (Triton, DeepGEMM, DeepEP) happen here, outside DBO, rather than inside a ubatch, where
        they would hold the other ubatches at a yield for minutes. The compiled step also runs
        a decode of two rows into the null cache block: the graph every step of more than one
        token shares; full graphs capture each size (`UBatchWrapper.capture_sizes`) the same way."""
        decodes = ([2] if self.compiled is not None else []) + self.wrapper.capture_sizes(max_decode_rows)
        steps = [[]] + [[ScheduledChunk([0], 0, [NULL_BLOCK])] * rows for rows in decodes]
        with contextlib.nullcontext() if self.compiled is None else self.compiled.compiling():
            for chunks in steps:
                plan = StepPlan(num_tokens=0, num_tokens_padded=max(len(chunks), 1), sbo=self.sbo)
                inputs = self.step_inputs(chunks, plan)
                with self.platform.use_device(self.device):
                    self.forward(inputs.input_ids, inputs, plan, count=False)

    def observe(self, plan: StepPlan, times: StepTimes) -> None:
        """Feed a completed step's time model back to the planner that chose its overlap."""
        observe_step(self.planner, plan.planned, plan.shape, times)

    @torch.no_grad()
    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        sampling: Sequence[SamplingParams],
        samplers: Sequence[RequestSampler | None],
        finishes_prompt: Sequence[bool] | None = None,
        future_slots: Sequence[int | None] | None = None,
    ) -> StepResult:
        """Run one step: plan, forward, sample, observe. `finishes_prompt[r]` says whether
        request r's chunk ends at the last known token (so a new token is sampled); default:
        every request samples. Negative input ids are `FutureMap` placeholders, resolved here;
        `future_slots[r]` is where request r's sampled token is published for the next step's
        placeholders."""
        if self.future_map is None and any(t < 0 for c in chunks for t in c.token_ids):
            raise ValueError("input ids hold FutureMap placeholders but this ModelRunner has no future_map")
        plan: StepPlan | None = None
        measured = None
        try:
            tokens = sum(len(c.token_ids) for c in chunks)
            with measure_step(self.wrapper.executor, self.tracer, tokens=tokens) as measured:
                with self.platform.use_device(self.device):
                    plan = self.plan_step(chunks)
                    result = self._run(plan, chunks, sampling, samplers, finishes_prompt, future_slots)
        finally:
            if measured is not None:
                self.last_step_times = measured.times
                self.total_step_times = self.total_step_times + measured.times
        self.observe(plan, measured.times)
        return result

    def _run(self, plan: StepPlan, chunks, sampling, samplers, finishes_prompt, future_slots) -> StepResult:
        inputs = self.step_inputs(chunks, plan)
        if self.future_map is not None and any(c.token_ids and min(c.token_ids) < 0 for c in chunks):
            inputs.input_ids = self.future_map.resolve(inputs.input_ids)  # 5 tensor ops: only with placeholders
        if plan.num_tokens_padded == 0:  # every DP rank is idle
            self.steps += 1
            self.idle_steps += 1
            return StepResult([], 0, 0, False)
        hidden = self.forward(inputs.input_ids, inputs, plan)
        if not chunks:
            return StepResult([], 0, plan.num_tokens_padded, plan.ubatched)
        wanted = list(finishes_prompt) if finishes_prompt is not None else [True] * len(chunks)
        rows = [r for r, w in enumerate(wanted) if w]
        sampled = self._sample_rows(hidden, inputs, sampling, samplers, rows)
        prompt = prompt_logprob_rows(self.model, hidden, inputs, chunks, sampling)
        if self.future_map is not None and future_slots is not None:
            published = [(i, future_slots[r]) for i, r in enumerate(rows) if future_slots[r] is not None]
            if published:
                picked = sampled.tokens[to_device_async(torch.tensor([i for i, _ in published]), self.device)]
                self.future_map.store([slot for _, slot in published], picked)
        read, logprobs, prompt_read = self._read_samples(sampled, [sampling[r] for r in rows], prompt, sampling)
        tokens = _scatter_rows(len(chunks), rows, read)
        step_logprobs = _scatter_rows(len(chunks), rows, logprobs) if logprobs is not None else None
        prompt_logprobs = _scatter_rows(len(chunks), prompt.owners, prompt_read) if prompt is not None else None
        return StepResult(
            tokens, inputs.num_tokens, plan.num_tokens_padded, plan.ubatched, step_logprobs, prompt_logprobs
        )

    def sample_tokens(self, hidden, inputs: StepInputs, sampling, samplers, wanted: Sequence[bool]) -> list[int | None]:
        """The next token of every request whose `wanted` is set (None elsewhere), from the
        final hidden state of its last scheduled token."""
        rows = [r for r, w in enumerate(wanted) if w]
        sampled = self._sample_rows(hidden, inputs, sampling, samplers, rows)
        return _scatter_rows(len(wanted), rows, self._read_samples(sampled, [sampling[r] for r in rows])[0])

    def _sample_rows(self, hidden, inputs: StepInputs, sampling, samplers, rows: list[int]) -> SampleOutput:
        """The samples of requests `rows`, on the device."""
        if inputs.uniform_decode and len(rows) == len(inputs.num_scheduled_tokens):
            last = hidden[: len(rows)]  # request r's one token is row r
        else:  # the last row of each sampling request, found on the host: no device read
            ends = torch.tensor(inputs.num_scheduled_tokens, dtype=torch.int64).cumsum(0) - 1
            last = hidden[to_device_async(ends[rows], self.device)]
        logits = self.model.compute_logits(last)
        return sample_step(logits, [sampling[r] for r in rows], [samplers[r] for r in rows])

    def _read_samples(self, sampled: SampleOutput, params: Sequence[SamplingParams],
                      prompt: PromptLogprobRows | None = None, sampling: Sequence[SamplingParams] = ()):
        """The step's one host read (`read_samples`), a method of its own so a profile can time it."""
        return read_samples(self.platform, sampled, params, prompt, sampling)


def split_ubatches(counts: list[int], contexts: list[int], num_ubatches: int, padded: int,
                   overlap: OverlapConfig, planner: OverlapPlanner | None):
    """Cut a step of `counts` tokens per request (after `contexts` computed ones) into
    `num_ubatches` ubatches as `overlap.ubatch_split` says: by tokens (TBO's balanced point
    for a prefill, `tbo_split_point`), or by cost, with attention priced by `planner`'s fit."""
    if overlap.ubatch_split == "tokens":
        return split_by_tokens(
            counts, num_ubatches, num_tokens_padded=padded, split_point=tbo_split_point(counts, num_ubatches, overlap)
        )
    weight = planner.model.attention_weight if planner is not None else None
    return split_by_cost(
        counts, contexts, num_ubatches, num_tokens_padded=padded,
        attention_weight=DEFAULT_ATTENTION_WEIGHT if weight is None else weight,
    )


def tbo_split_point(counts: list[int], num_ubatches: int, overlap: OverlapConfig) -> int | None:
    """Where TBO (the stages executor) cuts a two-ubatch prefill: SGLang's balanced split by
    sequences, or inside one sequence when no boundary is balanced enough; None (cut by
    tokens) for decode batches and for the other executors."""
    num_tokens = sum(counts)
    if overlap.executor != "stages" or num_ubatches != 2 or all(n == 1 for n in counts):
        return None
    split = balanced_split(counts, overlap.tbo_token_distribution_threshold)
    return split.token_index if 0 < split.token_index < num_tokens else None


def _scatter_rows(num_requests: int, rows: list[int], values: list[int]) -> list[int | None]:
    tokens: list[int | None] = [None] * num_requests
    for r, token in zip(rows, values):
        tokens[r] = token
    return tokens
