import random

import pytest
import torch

from tandem.platform import cpu_kernels
from tandem.worker.sampling import SamplingParams, sample, sample_one


def test_greedy_takes_the_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample_one(logits, SamplingParams(temperature=0), None) == 1
    assert sample_one(logits, SamplingParams(temperature=5.0, top_k=1), None) == 1


def test_same_seed_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(10, 50)
    params = SamplingParams(temperature=0.8, seed=1234)
    g = params.make_stream()
    again = [sample_one(row, params, g) for row in logits]
    g2 = params.make_stream()
    other = SamplingParams(temperature=0.8, seed=99)
    g_other = other.make_stream()
    interleaved = []
    for row in logits:  # another request sampling between our draws does not disturb them
        sample_one(row, other, g_other)
        interleaved.append(sample_one(row, params, g2))
    assert again == interleaved
    assert len(set(again)) > 1  # it really sampled


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0, -2.0])
    g = random.Random(0)
    picks = {sample_one(logits, SamplingParams(temperature=1.0, top_k=2), g) for _ in range(200)}
    assert picks <= {0, 1} and len(picks) == 2
    # exp(5) / (exp(5) + exp(4) + ...) ≈ 0.71: top_p 0.5 keeps only the first token.
    picks = {sample_one(logits, SamplingParams(temperature=1.0, top_p=0.5), g) for _ in range(50)}
    assert picks == {0}
    picks = {sample_one(logits, SamplingParams(temperature=1.0, top_p=0.9), g) for _ in range(300)}
    assert picks == {0, 1}


def test_draws_follow_the_distribution_and_never_take_a_token_without_mass():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log()  # -inf for the last token
    params = SamplingParams(temperature=1.0)
    rows = 4000
    tokens = sample(logits.expand(rows, -1), [params] * rows, [random.Random(7)] * rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=4) / rows
    assert torch.allclose(counts[:3], probs[:3], atol=0.03)
    assert counts[3] == 0


class _StreamAt:
    """A request's random stream that always answers `value`."""

    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


def test_the_end_of_the_unit_interval_lands_on_the_last_token_with_mass():
    # 1 - 2**-53 rounds to 1.0 in float32: the draw must still be a token the row can take.
    logits = torch.tensor([[2.0, 1.0, float("-inf"), float("-inf")], [float("-inf"), 0.0, float("-inf"), 1.0]])
    params = [SamplingParams(temperature=1.0)] * 2
    assert sample(logits, params, [_StreamAt(1 - 2**-53)] * 2) == [1, 3]
    assert sample(logits, params, [_StreamAt(0.0)] * 2) == [0, 1]


def test_batch_sampling_uses_each_requests_params():
    logits = torch.tensor([[0.0, 9.0], [9.0, 0.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0)]
    assert sample(logits, params, [None, None]) == [1, 0]


@pytest.mark.parametrize(
    "kwargs, message",
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -3}, "top_k")],
)
def test_bad_params_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_extreme_temperature_and_top_p_never_break_a_step():
    # logits / 1e-300 overflows to inf (softmax NaN); top_p=5e-324 is 0 in float32. Both must
    # still give a token (the greedy one), not raise and fail every request of the step.
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0])
    for params in (SamplingParams(temperature=1e-300, seed=1), SamplingParams(top_p=5e-324, seed=1)):
        assert sample_one(logits, params, params.make_stream()) == 1


def test_logit_bias_is_added_to_its_rows_before_sampling_and_not_to_raw_logprobs():
    from tandem.worker.sampling import SamplingParams, sample_step

    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    params = [
        SamplingParams(temperature=0, logit_bias={2: 10.0, 1: -100.0}, logprobs=1),
        SamplingParams(temperature=0, logprobs=1),
    ]
    out = sample_step(logits, params, [None, None])
    assert out.tokens.tolist() == [2, 0]  # row 0 biased to token 2; row 1 untouched
    # Log-probabilities are the model's raw ones (as vLLM's default): the bias is not in them.
    torch.testing.assert_close(out.logprobs[0, 0], torch.log_softmax(logits[0], -1)[2])
    # A token past the logits' width (a tokenizer larger than the model) is ignored, not an error.
    wide = sample_step(logits[:1], [SamplingParams(temperature=0, logit_bias={9: 100.0, 3: 100.0})], [None])
    assert wide.tokens.tolist() == [3]


@pytest.mark.parametrize("bias, match", [({-1: 1.0}, "token ids"), ({3: 100.5}, r"\[-100, 100\]"), ({3: float("nan")}, "lie in")])
def test_logit_bias_values_are_checked(bias, match):
    from tandem.worker.sampling import SamplingParams

    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)


@pytest.mark.skipif(not cpu_kernels.available(), reason="tandem's CPU kernels did not build here")
def test_the_cpu_kernel_draws_the_tokens_the_torch_ops_draw():
    """A step with only temperatures runs tandem's sampling kernel on the CPU: for the same
    uniforms it picks the torch path's tokens (greedy rows and tiny temperatures included),
    and it never picks a token without mass, even at the end of the unit interval."""
    torch.manual_seed(3)
    logits = torch.randn(64, 2048) * 4
    logits[:, 100:200] = float("-inf")
    params = [SamplingParams(temperature=t) for t in (0.0, 1e-30, 0.3, 1.0, 2.5) * 12 + (1.0,) * 4]
    draws = [random.Random(1000 + r) for r in range(len(params))]
    states = [random.Random(1000 + r) for r in range(len(params))]
    kernel = sample(logits, params, draws)
    with cpu_kernels.switched_off():
        torch_ops = sample(logits, params, states)
    assert kernel == torch_ops
    assert len(set(kernel)) > 20 and not any(100 <= t < 200 for t in kernel)
    edge = torch.tensor([[2.0, 1.0, float("-inf"), float("-inf")], [float("-inf"), 0.0, float("-inf"), 1.0]])
    assert cpu_kernels.sample(edge, [1.0, 1.0], [1 - 2**-53] * 2).tolist() == [1, 3]
    with pytest.raises(ValueError, match="2 rows of logits need as many temperatures and uniforms, got 1 and 2"):
        cpu_kernels.sample(edge, [1.0], [0.5, 0.5])
