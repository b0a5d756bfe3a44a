import pytest
import torch

from tandem.modular_kernels import select_experts, torch_moe_reference
from tandem.modular_kernels.routing import expert_mlp


def loop_grouped_topk(scores, bias, top_k, groups, topk_group):
    """Per-token reference for grouped top-k, written the slow, obvious way."""
    ids = []
    num_experts = scores.shape[1]
    size = num_experts // groups
    for t in range(scores.shape[0]):
        choice = scores[t] + (bias if bias is not None else 0)
        group_score = []
        for g in range(groups):
            members = sorted(choice[g * size : (g + 1) * size].tolist(), reverse=True)
            group_score.append(members[0] if bias is None else members[0] + members[1])
        kept = sorted(range(groups), key=lambda g: -group_score[g])[:topk_group]
        allowed = [e for e in range(num_experts) if e // size in kept]
        ids.append(sorted(allowed, key=lambda e: -float(choice[e]))[:top_k])
    return torch.tensor(ids)


def test_softmax_topk_renormalized():
    logits = torch.randn(5, 8)
    weights, ids = select_experts(logits, 2, renormalize=True)
    probs = torch.softmax(logits, -1)
    expected = probs.topk(2, -1)
    assert torch.equal(ids, expected.indices)
    torch.testing.assert_close(weights, expected.values / expected.values.sum(-1, keepdim=True))
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64


def test_softmax_without_renormalize_keeps_probabilities():
    logits = torch.randn(4, 6)
    weights, ids = select_experts(logits, 3, renormalize=False)
    torch.testing.assert_close(weights, torch.softmax(logits, -1).gather(1, ids))


def test_deepseek_v2_grouped_topk():
    torch.manual_seed(1)
    logits = torch.randn(6, 16)
    weights, ids = select_experts(logits, 3, renormalize=False, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5)
    scores = torch.softmax(logits, -1)
    expected = loop_grouped_topk(scores, None, 3, 4, 2)
    assert torch.equal(ids.sort(-1).values, expected.sort(-1).values)
    torch.testing.assert_close(weights, scores.gather(1, ids) * 2.5)


def test_deepseek_v3_sigmoid_with_correction_bias():
    torch.manual_seed(2)
    logits = torch.randn(6, 16)
    bias = torch.randn(16) * 0.5
    weights, ids = select_experts(
        logits, 4, renormalize=True, scoring="sigmoid", num_expert_group=4, topk_group=2,
        correction_bias=bias, routed_scaling_factor=2.0,
    )
    scores = torch.sigmoid(logits)
    expected = loop_grouped_topk(scores, bias, 4, 4, 2)
    assert torch.equal(ids.sort(-1).values, expected.sort(-1).values)
    picked = scores.gather(1, ids)  # weights come from unbiased scores
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True) * 2.0)


def test_bias_steers_choice_not_weights():
    logits = torch.zeros(1, 4)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    weights, ids = select_experts(logits, 1, renormalize=False, scoring="sigmoid", correction_bias=bias)
    assert ids.item() == 3
    assert weights.item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"top_k": 9}, "top_k"),
        ({"scoring": "tanh"}, "scoring"),
        ({"num_expert_group": 3, "topk_group": 1}, "groups"),
        ({"num_expert_group": 4, "topk_group": 5}, "topk_group"),
    ],
)
def test_bad_routing_arguments_are_named(kwargs, message):
    args = {"top_k": 2, "renormalize": True, **kwargs}
    with pytest.raises(ValueError, match=message):
        select_experts(torch.randn(2, 8), args.pop("top_k"), **args)


def test_reference_skips_masked_ids_and_weights_experts():
    torch.manual_seed(0)
    hidden = torch.randn(3, 8)
    w1, w2 = torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    ids = torch.tensor([[0, -1], [2, 3], [-1, -1]])
    weights = torch.tensor([[0.5, 9.0], [0.25, 0.75], [1.0, 1.0]])
    out = torch_moe_reference(hidden, w1, w2, weights, ids)
    torch.testing.assert_close(out[0], 0.5 * expert_mlp(hidden[0], w1[0], w2[0]))
    torch.testing.assert_close(
        out[1], 0.25 * expert_mlp(hidden[1], w1[2], w2[2]) + 0.75 * expert_mlp(hidden[1], w1[3], w2[3])
    )
    assert torch.count_nonzero(out[2]) == 0
