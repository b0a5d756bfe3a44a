"""TBO over DeepEP's normal (high-throughput) kernels (#31): the dispatch is two operations,
`dispatch_prepare` (casts, the ubatch's compute event) and `dispatch_send` (the layout and the
dispatch, which holds the host until the peers' counts arrive), and prefill's operation list
puts the stage's yield between them, so the other ubatch's work is issued before the host
waits. On 2 gloo ranks with the emulation of DeepEP's API (`tandem.testing.fake_deep_ep`)."""

from __future__ import annotations

import torch

from tandem.contexts import dbo_current_ubatch_id, execute_operations, execute_overlapped_operations
from tandem.models.layer_operations import DecoderLayerOperations
from tandem.modular_kernels import build_moe_kernel, select_experts
from tandem.testing import fake_deep_ep, run_distributed
from tests.support.moe_cases import NUM_EXPERTS, TOP_K, assert_every_case_passed, make_problem

HIDDEN = 2048
HALVES = (slice(0, 6), slice(6, 12))


class _MoELayer(DecoderLayerOperations):
    """A decoder layer around one MoE kernel: no norms, attention a recorded pass-through
    (so the log shows where each ubatch's compute is issued), a router matrix."""

    def __init__(self, kernel, expert_weights, router: torch.Tensor, log: list):
        self.self_attn = self.feed_forward = self
        self.kernel, self.expert_weights, self.router, self.log = kernel, expert_weights, router, log

    @staticmethod
    def input_layernorm(x, residual=None):
        return x if residual is None else (x + residual, x + residual)

    @staticmethod
    def post_attention_layernorm(x, residual):
        return x, residual

    def prepare(self, positions, x):
        return x

    def attention_core(self, prepared):
        self.log.append(("attn_core", dbo_current_ubatch_id()))
        return prepared * 0.5

    def router_logits(self, h):
        return h.float() @ self.router

    def select(self, logits):
        return select_experts(logits, TOP_K, renormalize=True)


def _recorded_buffer(buffer, log: list, seen: dict) -> None:
    """Log each call of the buffer with the ubatch that made it, and keep what the dispatch
    needs to be checked against: the event each ubatch's first half captured, and the tensors
    each layout returned."""
    for method in ("capture", "get_dispatch_layout", "dispatch", "combine"):
        inner = getattr(buffer, method)

        def recorded(*args, _method=method, _inner=inner, **kwargs):
            ubatch = dbo_current_ubatch_id()
            log.append((_method, ubatch))
            seen.setdefault((_method, ubatch), []).append(kwargs)
            out = _inner(*args, **kwargs)
            seen[(_method, ubatch)][-1]["returned"] = out
            return out

        setattr(buffer, method, recorded)


def _transfer_checks(seen: dict, layers: int) -> dict:
    """Per ubatch: one layout, one dispatch and one combine per layer, and two captures (the
    dispatch's first half, then the combine's right after the experts); the dispatch takes the
    layout's very tensors and waits on the event its own first half captured, and the combine,
    issued a stage later, on the event captured after its own experts: neither waits for the
    other ubatch's work queued in between."""
    report = {}
    for ubatch in (0, 1):
        layouts, dispatches = seen[("get_dispatch_layout", ubatch)], seen[("dispatch", ubatch)]
        combines = seen[("combine", ubatch)]
        captures = [c["returned"] for c in seen[("capture", ubatch)]]
        report[f"ubatch{ubatch}/once-per-layer"] = (
            len(layouts) == len(dispatches) == len(combines) == layers and len(captures) == 2 * layers
        )
        same = True
        for layout, dispatch, event in zip(layouts, dispatches, captures[0::2]):
            per_rank, _, per_expert, in_rank, _ = layout["returned"]
            same &= dispatch["num_tokens_per_rank"] is per_rank and dispatch["is_token_in_rank"] is in_rank
            same &= dispatch["num_tokens_per_expert"] is per_expert
            same &= layout["previous_event"] is event and dispatch["previous_event"] is event
            same &= dispatch["async_finish"] is True and not dispatch.get("allocate_on_comm_stream", False)
        report[f"ubatch{ubatch}/layout-tensors-and-own-event"] = bool(same)
        report[f"ubatch{ubatch}/combine-waits-on-its-own-experts"] = all(
            combine["previous_event"] is event for combine, event in zip(combines, captures[1::2])
        )
    return report


def _split_cases(rank, world):
    fake_deep_ep.install()
    torch.manual_seed(0)
    p = make_problem(rank, "random", hidden=HIDDEN, intermediate=32)
    kernel = build_moe_kernel(
        "deepep_high_throughput", "torch", num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN,
        shared_experts=p.shared_experts,
    )  # fmt: skip
    log, seen = [], {}
    router = torch.randn(HIDDEN, NUM_EXPERTS, generator=torch.Generator().manual_seed(1))
    layers = [_MoELayer(kernel, p.local_weights(rank, world), router, log) for _ in range(2)]
    inputs = [{"hidden_states": p.hidden[rows], "positions": None} for rows in HALVES]

    def tbo():
        strategies = [layer.operations_strategy(decode=False) for layer in layers]
        ops = [op for s in strategies for op in s.operations]
        outs = execute_overlapped_operations(inputs, [ops, ops], [0, strategies[0].delta_stages])
        return [o["hidden_states"] + o["residual"] for o in outs]

    report = {"backend-yields-in-send": kernel.prepare_finalize.yields_in_send}
    _recorded_buffer(kernel.prepare_finalize.ensure_buffer(HIDDEN), log, seen)
    split = tbo()
    # As the host issues them: the other ubatch's attention between a ubatch's first half
    # (capture) and its blocking send (layout, dispatch); the combine's capture right after
    # the experts; each combine a stage later, behind both dispatches on DeepEP's one comm
    # stream, with the next layer's attention and capture.
    layer_start = [("attn_core", 0), ("capture", 0), ("attn_core", 1), ("capture", 1)]
    sends = [("get_dispatch_layout", 0), ("dispatch", 0), ("capture", 0),
             ("get_dispatch_layout", 1), ("dispatch", 1), ("capture", 1)]
    report["issue-order"] = log == [
        *layer_start[:2], *layer_start[2:], *sends,
        ("combine", 0), *layer_start[:2], ("combine", 1), *layer_start[2:], *sends,
        ("combine", 0), ("combine", 1),
    ]  # fmt: skip
    report.update(_transfer_checks(seen, len(layers)))

    # The same numbers as the cut before the split (send before the yield, combine with the
    # experts) and as each ubatch run alone.
    log.clear()
    kernel.prepare_finalize.yields_in_send = False  # this instance only: the list's old cut
    unsplit = tbo()
    report["old-cut-sends-before-the-other-attention"] = log[:4] == [
        ("attn_core", 0), ("capture", 0), ("get_dispatch_layout", 0), ("dispatch", 0)
    ]
    kernel.prepare_finalize.yields_in_send = True
    alone = []
    for ubatch_inputs in inputs:
        out = ubatch_inputs
        for layer in layers:
            out = execute_operations(out, layer.operations_strategy(decode=False).operations)
        alone.append(out["hidden_states"] + out["residual"])
    for i in (0, 1):
        report[f"ubatch{i}/bit-identical-to-old-cut"] = torch.equal(split[i], unsplit[i])
        report[f"ubatch{i}/bit-identical-to-alone"] = torch.equal(split[i], alone[i])
    return report


def test_tbo_issues_the_blocking_dispatch_after_the_other_ubatchs_stage():
    per_rank = run_distributed(_split_cases, 2, timeout_s=150)
    assert_every_case_passed(per_rank, 13)
