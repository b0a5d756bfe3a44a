"""Routing in one Triton kernel: scores (softmax or sigmoid of the logits, in float32),
an optional score-correction bias that only steers the choice, top-k by repeated argmax,
the weights from the unbiased scores, renormalised and scaled, optionally limited to the
best groups of experts (DeepSeek's grouped top-k). One program per token; `routing.
select_experts` takes it on CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tandem.platform import triton_utils


def _define(triton) -> SimpleNamespace:
    tl = triton.language

    @triton.jit
    def topk_kernel(
        logits_ptr, bias_ptr, weights_ptr, ids_ptr,
        E, stride_l, scale,
        TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
        N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        experts = tl.arange(0, BLOCK_E)
        ok = experts < E
        logits = tl.load(logits_ptr + token * stride_l + experts, mask=ok, other=-float("inf")).to(tl.float32)
        if SIGMOID:
            scores = 1.0 / (1.0 + tl.exp(-logits))
        else:
            shifted = tl.exp(logits - tl.max(logits, axis=0))
            scores = shifted / tl.sum(shifted, axis=0)
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + experts, mask=ok, other=0.0).to(tl.float32)
        choice = tl.where(ok, choice, -float("inf"))
        if N_GROUP > 1:
            # Groups ranked by their best choice (with a bias: the sum of their best two);
            # the experts of all but the best TOPK_GROUP groups are masked out.
            group_of = experts // GROUP_SIZE
            groups = tl.arange(0, BLOCK_G)
            group_scores = tl.full((BLOCK_G,), -float("inf"), dtype=tl.float32)
            for g in tl.static_range(N_GROUP):
                member = tl.where(group_of == g, choice, -float("inf"))
                score = tl.max(member, axis=0)
                if HAS_BIAS and GROUP_SIZE > 1:
                    second = tl.where(experts == tl.argmax(member, axis=0), -float("inf"), member)
                    score = score + tl.max(second, axis=0)
                group_scores = tl.where(groups == g, score, group_scores)
            kept = tl.zeros((BLOCK_E,), dtype=tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                best_group = tl.argmax(group_scores, axis=0)
                kept = kept | (group_of == best_group)
                group_scores = tl.where(groups == best_group, -float("inf"), group_scores)
            choice = tl.where(kept, choice, -float("inf"))
        slots = tl.arange(0, BLOCK_K)
        picked_ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
        picked = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            best = tl.argmax(choice, axis=0)
            weight = tl.sum(tl.where(experts == best, scores, 0.0), axis=0)
            picked_ids = tl.where(slots == k, best.to(tl.int64), picked_ids)
            picked = tl.where(slots == k, weight, picked)
            choice = tl.where(experts == best, -float("inf"), choice)
        if RENORMALIZE:
            picked = picked / tl.sum(picked, axis=0)
        keep = slots < TOP_K
        tl.store(weights_ptr + token * TOP_K + slots, picked * scale, mask=keep)
        tl.store(ids_ptr + token * TOP_K + slots, picked_ids, mask=keep)

    return SimpleNamespace(topk=topk_kernel)


def fused_topk_triton(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(topk_weights float32 [T, K], topk_ids int64 [T, K])`, as `select_experts` (whose
    checks on the arguments it relies on)."""
    n_group = num_expert_group or 1
    num_tokens, num_experts = router_logits.shape
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=device)
    if num_tokens:
        triton_utils.kernels(_define).topk[(num_tokens,)](
            router_logits, router_logits if correction_bias is None else correction_bias, weights, ids,
            num_experts, router_logits.stride(0), float(routed_scaling_factor),
            TOP_K=top_k, SIGMOID=scoring == "sigmoid", HAS_BIAS=correction_bias is not None,
            RENORMALIZE=renormalize, N_GROUP=n_group, TOPK_GROUP=topk_group or 1, GROUP_SIZE=num_experts // n_group,
            BLOCK_E=triton_utils.next_power_of_2(num_experts), BLOCK_K=triton_utils.next_power_of_2(top_k),
            BLOCK_G=triton_utils.next_power_of_2(n_group),
        )  # fmt: skip
    return weights, ids


__all__ = ["fused_topk_triton"]
