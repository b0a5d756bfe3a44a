"""`UBatchWrapper`: run any model as DBO ubatches, eagerly or from captured graphs.

The wrapper is a drop-in callable `wrapper(*token_tensors, **kwargs)` around a model whose
MoE layers use `FusedMoEModularKernel`. It reads the forward context:

- no `ubatch_slices`: one plain forward;
- `ubatch_slices`: each positional tensor is cut along dim 0 by the slices' token ranges,
  the attention metadata is split per ubatch (`AttentionMetadata.split`), every ubatch runs
  the model on its own executor worker (thread or greenlet) under its own forward context,
  and the outputs (tensors, or tuples / lists of tensors) are concatenated back;
- `ubatch_slices` with the `"stages"` executor (TBO): the model's `operations_inputs` runs
  on the whole batch (embedding, leading dense layers), its per-ubatch inputs are
  interleaved stage by stage through `operations_strategy(decode)` on the caller's thread,
  each stage under its ubatch's forward context, and `operations_output` finishes each
  ubatch's result (the final norm, row by row) before they are concatenated.

`graph_mode="full"` captures one graph per (padded token count, ubatch count, TBO strategy, SBO choice) for
decode-only batches (`AttentionMetadata.decode_only`) of up to `max_graph_tokens` tokens,
as vLLM's full decode graphs do; other batches run eagerly. A capture runs the step once
with the ubatch workers live (their ops join the capture, see `tandem.platform.graph`); a
replay copies the new inputs and metadata into the graph's static buffers and re-runs the
recorded work with no worker, no `dbo_yield` and no model Python. Inside a graph every row
is a request (padding rows are requests of length 0, written to the null cache block), so
the shapes depend only on the token count and the block-table width: `max_blocks_per_seq`
(the runner passes `ceil(max_model_len / block_size)`), or, when not given, a width that
doubles, with a recapture, whenever a sequence outgrows it. The returned tensors
of a replay are the graph's static outputs: read them before the next step of that size.

A decode step pads to the next of `graph_sizes(max_graph_tokens)` (`ModelRunner.plan_step`),
and the runner captures every size up to `--max-num-seqs` at start-up, largest first
(`ModelRunner.warm_up`): serving meets a handful of sizes, all captured before the first
request, instead of a capture (a stall of 0.3-1 s on a GPU) at each new batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from tandem.contexts import (
    DEFAULT_TIMEOUT_S,
    ForwardContext,
    StageExecutor,
    UBatchExecutor,
    get_forward_context,
    make_executor,
    make_ubatch_contexts,
    set_forward_context,
)
from tandem.contexts.ubatch_context import current_ubatch_context
from tandem.models.paged_attention import AttentionMetadata
from tandem.modular_kernels.capturable import check_graph_capturable
from tandem.modular_kernels.sm_partition import comm_sm_partition
from tandem.platform import Graph, Platform, get_platform, graph_capture_active
from tandem.ubatch import UBatchSlice, split_by_tokens

def merge_outputs(outputs: Sequence[Any]) -> Any:
    """Concatenate per-ubatch outputs along dim 0, element by element for tuples/lists."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs), dim=0)
    if isinstance(first, (tuple, list)):
        merged = [merge_outputs([out[i] for out in outputs]) for i in range(len(first))]
        return type(first)(merged)
    if first is None and all(out is None for out in outputs):
        return None
    raise TypeError(f"cannot merge ubatch outputs of type {type(first).__name__}: return tensors or tuples of tensors")


def _parameter_device(model: Any) -> torch.device | None:
    """The device of the model's parameters (None when it has none): the platform follows it."""
    parameters = getattr(model, "parameters", None)
    first = next(iter(parameters()), None) if callable(parameters) else None
    return None if first is None else first.device


@dataclass
class _StepGraph:
    """A captured step and the static buffers its replay reads and writes."""

    graph: Graph
    inputs: list[torch.Tensor]
    metadata: AttentionMetadata
    outputs: Any


#: The stall watchdog's limit in the first ubatched run of each ubatch count (the cold start:
#: JIT compiles and lazy init happen between two yields there).
COLD_START_TIMEOUT_S = 1800.0


#: The decode sizes graphs are captured at: fine steps where a padding row costs most
#: (small batches), coarser above; a step pads to the next (at most 7 padding rows up to
#: 32 rows, fewer than half its rows above).
GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def graph_sizes(max_graph_tokens: int) -> tuple[int, ...]:
    """The captured sizes up to `max_graph_tokens` (which is one of them)."""
    return tuple(s for s in GRAPH_SIZES if s < max_graph_tokens) + (max_graph_tokens,)


def graph_size(num_tokens: int, max_graph_tokens: int) -> int | None:
    """The captured size a decode step of `num_tokens` pads to; None past the largest (eager)."""
    return next((s for s in graph_sizes(max_graph_tokens) if s >= num_tokens), None)


def resolve_graph_mode(mode: str, device: torch.device, model: Any, *, compiled: bool) -> str:
    """`--graph-mode auto`: full on CUDA, where an eager decode step is bound by the host
    launching its kernels (~735 a step at DeepSeek-V2-Lite's shape, gpu-review-3 G1), when
    the model's MoE backends can be captured and the step is not compiled; none on the CPU,
    where a replay measured slower than eager (`CpuGraph`, docs/compiled-step.md)."""
    if mode != "auto":
        return mode
    if device.type != "cuda" or compiled:
        return "none"
    try:
        check_graph_capturable(model)
    except ValueError:
        return "none"
    return "full"


def eager_unless_asked(overlap):
    """`overlap` with `--graph-mode auto` as none: for tools whose steps must run eagerly
    (module hooks, per-step mode switches) unless graphs are asked for by name."""
    return replace(overlap, graph_mode="none") if overlap.graph_mode == "auto" else overlap


class UBatchWrapper:
    def __init__(
        self,
        model: Any,
        *,
        num_ubatches: int = 2,
        executor: str | UBatchExecutor | StageExecutor = "thread",
        graph_mode: str = "none",
        max_graph_tokens: int = 512,
        max_blocks_per_seq: int | None = None,
        platform: Platform | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        comm_sms: int | None = None,
    ):
        if num_ubatches < 2:
            raise ValueError(f"num_ubatches must be at least 2, got {num_ubatches}")
        if graph_mode not in ("none", "full"):
            raise ValueError(f"graph_mode must be none or full (resolve auto with resolve_graph_mode), got {graph_mode!r}")
        if graph_mode == "full":
            check_graph_capturable(model)
        self.model = model
        #: SMs for communication kernels while ubatches overlap (`--comm-sms`; GPU only).
        self.comm_sms = comm_sms
        self.num_ubatches = num_ubatches
        if executor == "stages":
            executor = StageExecutor()
        self.executor = make_executor(executor, timeout) if isinstance(executor, str) else executor
        self.graph_mode = graph_mode
        self.max_graph_tokens = max_graph_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.platform = platform or get_platform(_parameter_device(model))
        self.timeout = timeout
        #: Ubatch counts that have run once. The first run of each is the cold start: lazy
        #: library init and JIT compilation (Triton, DeepGEMM) inside one ubatch segment,
        #: which may take minutes, so the stall watchdog gets `COLD_START_TIMEOUT_S` there.
        self._warm_ubatch_counts: set[int] = set()
        #: One comm stream for every run of this wrapper (as vLLM keeps one), made on first use:
        #: streams are not free to create, and a graph's captured work refers to it.
        self._comm_stream: Any = None
        self.graphs: dict[tuple[int, int, bool | None, bool | None], _StepGraph] = {}
        #: Forwards run, by how: plain eager, eager as ubatches, graph captures, graph replays.
        self.eager_runs = 0
        self.ubatched_runs = 0
        self.graph_captures = 0
        self.graph_replays = 0

    def __call__(self, *inputs: torch.Tensor, **kwargs: Any) -> Any:
        ctx = get_forward_context()
        if self.graph_mode == "full" and self._graphable(ctx, inputs):
            return self._run_graph(ctx, inputs, kwargs)
        return self._run_eager(ctx, inputs, kwargs)

    # -- eager ---------------------------------------------------------------------------

    def _run_eager(
        self, ctx: ForwardContext | None, inputs: Sequence[torch.Tensor], kwargs: dict, prepare_streams: bool = False
    ) -> Any:
        slices = ctx.ubatch_slices if ctx is not None else None
        if not slices:
            self.eager_runs += 1
            return self.model(*inputs, **kwargs)
        num_tokens = inputs[0].shape[0] if inputs else 0
        if slices[-1].token_slice.stop != num_tokens:
            raise ValueError(
                f"ubatch slices cover {slices[-1].token_slice.stop} tokens but the inputs have {num_tokens}"
            )
        metadata = ctx.attn_metadata
        if metadata is None:
            per_ubatch = [None] * len(slices)
        elif isinstance(metadata, AttentionMetadata):
            per_ubatch = metadata.split(list(slices))
        else:
            raise TypeError(f"UBatchWrapper cannot split attention metadata of type {type(metadata).__name__}")
        sub_contexts = [
            replace(ctx, attn_metadata=m, ubatch_slices=None, extras={**ctx.extras, "ubatch_index": i})
            for i, m in enumerate(per_ubatch)
        ]
        if self.executor.runs_operations:
            self.ubatched_runs += 1
            return self._run_stages(ctx, inputs, slices, sub_contexts, kwargs)

        def ubatch(index: int, ub: UBatchSlice):
            if prepare_streams:
                self._prepare_streams_for_capture()
            with set_forward_context(sub_contexts[index]):
                return self.model(*(x[ub.token_slice] for x in inputs), **kwargs)

        fns = [lambda i=i, ub=ub: ubatch(i, ub) for i, ub in enumerate(slices)]
        if self._comm_stream is None:
            self._comm_stream = self.platform.new_stream()
        cold = len(fns) not in self._warm_ubatch_counts
        contexts = make_ubatch_contexts(
            len(fns),
            executor=self.executor.kind,
            comm_stream=self._comm_stream,
            platform=self.platform,
            timeout=max(self.timeout, COLD_START_TIMEOUT_S) if cold else self.timeout,
        )
        self.ubatched_runs += 1
        with comm_sm_partition(self.comm_sms):
            outputs = merge_outputs(self.executor.run(fns, contexts))
        self._warm_ubatch_counts.add(len(fns))
        return outputs

    def _prepare_streams_for_capture(self) -> None:
        """In a ubatch worker, before a capture: set up its library state (cuBLAS handle and
        workspaces) on both streams it will issue work on, outside the capture."""
        if graph_capture_active():
            return
        ubatch = current_ubatch_context()
        if ubatch is not None:
            self.platform.prepare_stream_for_capture(ubatch.compute_stream)
            self.platform.prepare_stream_for_capture(ubatch.comm_stream)

    def _run_stages(self, ctx, inputs, slices, sub_contexts, kwargs) -> Any:
        model = self.model
        if not hasattr(model, "operations_strategy"):
            raise TypeError(
                f"{type(model).__name__} exposes no operations (operations_inputs / operations_strategy / "
                "operations_output): use the thread or greenlet executor for it"
            )
        whole = model.operations_inputs(*inputs, **kwargs)
        per_ubatch = [{name: value[ub.token_slice] for name, value in whole.items()} for ub in slices]
        metadata = ctx.attn_metadata
        decode = ctx.tbo_decode
        if decode is None:
            decode = isinstance(metadata, AttentionMetadata) and metadata.decode_only
        strategy = model.operations_strategy(decode=decode)
        outputs = self.executor.run(
            per_ubatch,
            [strategy.operations] * len(slices),
            [i * strategy.delta_stages for i in range(len(slices))],
            forward_contexts=sub_contexts,
        )
        # Each ubatch finished on its own rows (the final norm folds the last residual add), so
        # one [T, H] tensor is concatenated, not the hidden states and the residual apart.
        return merge_outputs([model.operations_output(out) for out in outputs])

    # -- graphs --------------------------------------------------------------------------

    def graph_padded(self, num_tokens: int) -> int:
        """The size a decode step of `num_tokens` rows runs at: the next captured size under
        full graphs (unchanged past the largest, or without graphs)."""
        if self.graph_mode != "full" or not num_tokens:
            return num_tokens
        return graph_size(num_tokens, self.max_graph_tokens) or num_tokens

    def capture_sizes(self, max_decode_rows: int | None = None) -> list[int]:
        """The decode sizes to capture at start-up, largest first (as vLLM does: the smaller
        graphs reuse the larger ones' memory pool): each a step of up to `max_decode_rows`
        rows (default: the largest graph) may pad to; none without full graphs."""
        if self.graph_mode != "full":
            return []
        top = self.graph_padded(min(max_decode_rows or self.max_graph_tokens, self.max_graph_tokens))
        return [size for size in reversed(graph_sizes(self.max_graph_tokens)) if size <= top]

    def _graphable(self, ctx: ForwardContext | None, inputs: Sequence[torch.Tensor]) -> bool:
        if ctx is None or not isinstance(ctx.attn_metadata, AttentionMetadata) or not inputs:
            return False
        num_tokens = inputs[0].shape[0]
        return ctx.attn_metadata.decode_only and 0 < num_tokens <= self.max_graph_tokens

    def _run_graph(self, ctx: ForwardContext, inputs: Sequence[torch.Tensor], kwargs: dict) -> Any:
        metadata: AttentionMetadata = ctx.attn_metadata
        num_tokens = inputs[0].shape[0]
        num_ubatches = len(ctx.ubatch_slices) if ctx.ubatch_slices else 0
        # The SBO choice and TBO's strategy change the recorded work: each gets its own graph.
        key = (num_tokens, num_ubatches, ctx.tbo_decode, ctx.sbo)
        step = self.graphs.get(key)
        if step is not None and step.metadata.block_table.shape[1] < metadata.block_table.shape[1]:
            step.graph.reset()  # sequences outgrew the captured block table: capture wider
            step = None
        if step is None:
            step = self._capture(ctx, inputs, kwargs, num_ubatches)
            self.graphs[key] = step
            return step.outputs
        self._fill(step, inputs, metadata)
        self.graph_replays += 1
        return step.graph.replay()

    def _capture(self, ctx: ForwardContext, inputs: Sequence[torch.Tensor], kwargs: dict, num_ubatches: int) -> _StepGraph:
        metadata: AttentionMetadata = ctx.attn_metadata
        num_tokens = inputs[0].shape[0]
        static_inputs = [x.clone() for x in inputs]
        # On the metadata's device: a replay must not copy from the host or mix devices.
        static_metadata = replace(
            metadata,
            query_start_loc=torch.arange(
                num_tokens + 1, dtype=metadata.query_start_loc.dtype, device=metadata.query_start_loc.device
            ),
            seq_lens=torch.zeros(num_tokens, dtype=metadata.seq_lens.dtype, device=metadata.seq_lens.device),
            max_query_len=1,
            slot_mapping=torch.empty_like(metadata.slot_mapping),
            block_table=torch.zeros(
                (num_tokens, self._block_table_width(metadata)),
                dtype=metadata.block_table.dtype,
                device=metadata.block_table.device,
            ),
            decode_only=True,
            # The replayed decode path reads the device tensors only; host copies would go stale.
            query_start_loc_host=None,
            seq_lens_host=None,
        )
        step = _StepGraph(self.platform.new_graph(), static_inputs, static_metadata, None)
        self._fill(step, inputs, metadata)
        # Inside the graph every row is a request, so the ubatch split depends on the size only.
        slices = split_by_tokens([1] * num_tokens, num_ubatches) if num_ubatches else None
        static_context = replace(ctx, attn_metadata=static_metadata, ubatch_slices=slices, extras=dict(ctx.extras))

        def forward() -> Any:
            # The graph's warm-up run (outside the capture) prepares the workers' streams.
            with set_forward_context(static_context):
                return self._run_eager(static_context, static_inputs, kwargs, prepare_streams=True)

        outputs = step.graph.capture(forward)
        if not step.graph.capture_computes_outputs:
            outputs = step.graph.replay()
        step.outputs = outputs
        self.graph_captures += 1
        return step

    def _block_table_width(self, metadata: AttentionMetadata) -> int:
        width = metadata.block_table.shape[1]
        if self.max_blocks_per_seq is not None:
            if width > self.max_blocks_per_seq:
                raise ValueError(f"block table is {width} blocks wide, over max_blocks_per_seq={self.max_blocks_per_seq}")
            return self.max_blocks_per_seq
        # Unknown bound: leave room to grow, so a long decode recaptures O(log n) times.
        return max(8, 1 << (width - 1).bit_length())

    @staticmethod
    def _fill(step: _StepGraph, inputs: Sequence[torch.Tensor], metadata: AttentionMetadata) -> None:
        for static, x in zip(step.inputs, inputs):
            static.copy_(x)
        static = step.metadata
        requests, width = metadata.block_table.shape
        static.seq_lens.zero_()
        static.seq_lens[:requests].copy_(metadata.seq_lens)
        static.block_table.zero_()
        static.block_table[:requests, :width].copy_(metadata.block_table)
        static.slot_mapping.copy_(metadata.slot_mapping)


__all__ = [
    "GRAPH_SIZES", "UBatchWrapper", "eager_unless_asked", "graph_size", "graph_sizes", "merge_outputs",
    "resolve_graph_mode",
]  # fmt: skip
