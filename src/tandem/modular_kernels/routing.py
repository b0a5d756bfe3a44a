"""Top-k expert routing for the MoE families tandem serves, and the per-token oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.platform import cpu_kernels, triton_utils
from tandem.modular_kernels.topk_kernel import fused_topk_triton


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    scoring: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(topk_weights float32 [T, K], topk_ids int64 [T, K])`.

    - Mixtral / Qwen-MoE: `scoring="softmax"`, plain top-k, `renormalize` as configured.
    - DeepSeek-V2: softmax with grouped top-k (`num_expert_group`, `topk_group`): groups are
      ranked by their best expert score.
    - DeepSeek-V3: `scoring="sigmoid"` with `correction_bias`: the bias only steers the
      choice (groups ranked by the sum of their two best biased scores); weights come from
      the unbiased scores.

    On CUDA this is one Triton kernel (`topk_kernel.py`); plain softmax routing on the CPU is
    one of tandem's kernels (`cpu_kernels.topk_softmax`).
    """
    group_limited = _check_routing(router_logits, top_k, scoring, num_expert_group, topk_group)
    if triton_utils.use_triton(router_logits):
        return fused_topk_triton(
            router_logits, top_k, renormalize=renormalize, scoring=scoring, correction_bias=correction_bias,
            routed_scaling_factor=routed_scaling_factor, num_expert_group=num_expert_group if group_limited else None,
            topk_group=topk_group,
        )  # fmt: skip
    if scoring == "softmax" and not group_limited and correction_bias is None and cpu_kernels.takes_eager(router_logits):
        topk_weights, topk_ids = cpu_kernels.topk_softmax(router_logits, top_k, renormalize)
        return topk_weights if routed_scaling_factor == 1.0 else topk_weights * routed_scaling_factor, topk_ids
    if scoring == "softmax":
        scores = torch.softmax(router_logits.float(), dim=-1)
    else:
        scores = torch.sigmoid(router_logits.float())

    choice = scores if correction_bias is None else scores + correction_bias.float().unsqueeze(0)
    if group_limited:
        choice = _keep_best_groups(choice, num_expert_group, topk_group, biased=correction_bias is not None)

    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids


def _check_routing(
    router_logits: torch.Tensor, top_k: int, scoring: str, num_expert_group: int | None, topk_group: int | None
) -> bool:
    """Raise a ValueError on arguments `select_experts` cannot route with; return whether
    the routing is group-limited (more than one expert group)."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, experts], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must lie in [1, {num_experts}]")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown scoring {scoring!r}: expected 'softmax' or 'sigmoid'")
    group_limited = num_expert_group is not None and num_expert_group > 1
    if group_limited:
        if topk_group is None or not 1 <= topk_group <= num_expert_group:
            raise ValueError(f"topk_group={topk_group} must lie in [1, num_expert_group={num_expert_group}]")
        if num_experts % num_expert_group:
            raise ValueError(f"{num_experts} experts do not split into {num_expert_group} groups")
    return group_limited


def _keep_best_groups(choice: torch.Tensor, num_expert_group: int, topk_group: int, *, biased: bool) -> torch.Tensor:
    """`choice [T, E]` with every expert outside each token's `topk_group` best groups set to
    -inf: groups ranked by their best score, or by the sum of their two best when `biased`."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, num_expert_group, -1)
    if not biased:
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    kept_groups = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return choice.masked_fill(~expert_mask, float("-inf"))


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: `w2 @ (silu(gate) * up)` with `w1` rows `[:I]` gate and `[I:]` up."""
    gate, up = (x @ w1.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def torch_moe_reference(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The obvious per-token loop in float32: the oracle for every backend. An id of -1
    contributes nothing."""
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        x = hidden[t].float()
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e < 0:
                continue
            out[t] += float(topk_weights[t, k]) * expert_mlp(x, w1[e].float(), w2[e].float())
    return out.to(hidden.dtype)
