"""vLLM's sampling extensions in the batched sampler: min_tokens, the three penalties, min_p,
raw log-probabilities, each with its vLLM meaning."""

import pytest
import torch

from tandem.worker.sampling import SamplingParams, sample_step, sample_tokens

EOS = 0


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 8), **kw)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])  # eos (0) first, stop id 2 second
    params = greedy(min_tokens=2, stop_token_ids=[2])
    state = params.make_sampler([1], [EOS])
    assert sample_tokens(logits, [params], [state]).tolist() == [1]
    assert sample_tokens(logits, [params], [state]).tolist() == [1]
    assert sample_tokens(logits, [params], [state]).tolist() == [0]  # two sampled: eos allowed again
    ignoring = greedy(min_tokens=1, ignore_eos=True, stop_token_ids=[2])
    assert sample_tokens(logits, [ignoring], [ignoring.make_sampler([1], [EOS])]).tolist() == [0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.2]])
    params = greedy(repetition_penalty=2.0)
    state = params.make_sampler(prompt_ids=[0, 2], eos_token_ids=[])
    out = sample_step(logits, [params], [state])
    assert out.tokens.tolist() == [1]  # 2.0 / 2 = 1.0 < 1.5
    # Token 1 is now an output token: 1.5 / 2 = 0.75 < 1.0 (token 0's 2.0 / 2).
    assert sample_tokens(logits, [params], [state]).tolist() == [0]
    # A negative seen logit moves away from zero: -1.0 * 2 = -2 < -1.2 (unseen token 3).
    only_negative = torch.tensor([[-5.0, -5.0, -1.0, -1.2]])
    fresh = params.make_sampler(prompt_ids=[2], eos_token_ids=[])
    assert sample_tokens(only_negative, [params], [fresh]).tolist() == [3]


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    freq = greedy(frequency_penalty=0.4)
    state = freq.make_sampler(prompt_ids=[1, 1, 1], eos_token_ids=[])
    # The prompt's token 1 is not penalized; 0 is chosen, then 3.0-0.4 > 2.5, then 3.0-0.8 < 2.5.
    picks = [sample_tokens(logits, [freq], [state]).item() for _ in range(3)]
    assert picks == [0, 0, 1]
    pres = greedy(presence_penalty=0.6)
    state = pres.make_sampler(prompt_ids=[], eos_token_ids=[])
    assert [sample_tokens(logits, [pres], [state]).item() for _ in range(3)] == [0, 1, 0]


def test_penalties_are_per_row_in_a_batch():
    logits = torch.tensor([[3.0, 2.5], [3.0, 2.5], [3.0, 2.5]])
    params = [greedy(presence_penalty=1.0), greedy(), greedy(frequency_penalty=2.0)]
    states = [p.make_sampler() for p in params]
    first = sample_tokens(logits, params, states).tolist()
    second = sample_tokens(logits, params, states).tolist()
    assert first == [0, 0, 0] and second == [1, 0, 1]


def test_min_p_cuts_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, min_p=0.5, seed=3)
    state = params.make_sampler()
    picks = {sample_tokens(logits, [params], [state]).item() for _ in range(300)}
    assert picks == {0, 1}  # 0.15 < 0.5 * 0.5


def test_raw_logprobs_of_the_sampled_token_and_the_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, 0.0, 4.0, 1.0]])
    params = [greedy(logprobs=2, repetition_penalty=2.0), greedy(logprobs=0)]
    states = [p.make_sampler(prompt_ids=[1]) for p in params]
    out = sample_step(logits, params, states)
    expected = logits.log_softmax(-1)
    assert out.tokens.tolist() == [2, 2]  # the penalty moved request 0 off token 1 ...
    # ... but its log-probabilities are the model's raw ones (vLLM's default).
    assert out.logprob_ids[0].tolist() == [2, 1, 2]
    torch.testing.assert_close(out.logprobs[0], expected[0, [2, 1, 2]])
    torch.testing.assert_close(out.logprobs[1, 0], expected[1, 2])


@pytest.mark.parametrize(
    "kwargs, name",
    [({"min_tokens": 9, "max_tokens": 8}, "min_tokens"), ({"repetition_penalty": 0}, "repetition_penalty"),
     ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
     ({"min_p": 1.5}, "min_p"), ({"logprobs": 21}, "logprobs")],
)
def test_bad_extension_values_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)
