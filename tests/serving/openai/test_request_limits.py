"""Each generation request builds its own `SamplingParams`, and every limit (`max_tokens`,
`n`, choices, the context length) is checked there, once, for both endpoints."""

from __future__ import annotations

import pytest

from tandem.serving.openai import protocol as P


def _chat(**fields) -> P.ChatCompletionRequest:
    return P.parse_request(P.ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})


def _completion(**fields) -> P.CompletionRequest:
    return P.parse_request(P.CompletionRequest, {"prompt": "hi", **fields})


def _error(call) -> P.APIError:
    with pytest.raises(P.APIError) as caught:
        call()
    return caught.value


def test_chat_without_a_budget_gets_the_rest_of_the_context():
    params = _chat(n=2, seed=5).sampling_params([30], max_model_len=128)
    assert [p.max_tokens for p in params] == [98, 98] and [p.seed for p in params] == [5, 6]


def test_a_chat_prompt_that_fills_the_context_is_refused_naming_the_messages():
    err = _error(lambda: _chat().sampling_params([128], max_model_len=128))
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "messages")
    assert "128 in the prompt + 1 for 'max_tokens'" in err.message


def test_max_completion_tokens_wins_and_is_the_field_an_error_names():
    assert _chat(max_tokens=3, max_completion_tokens=7).sampling_params([4], 128)[0].max_tokens == 7
    err = _error(lambda: _chat(max_tokens=3, max_completion_tokens=0).sampling_params([4], 128))
    assert err.param == "max_completion_tokens" and "at least 1, got 0" in err.message
    err = _error(lambda: _chat(max_completion_tokens=200).sampling_params([4], 128))
    assert (err.param, err.code) == ("max_completion_tokens", "context_length_exceeded")


def test_completion_budget_echo_only_and_logprob_counts():
    assert _completion().sampling_params([2], 128)[0].max_tokens == P.DEFAULT_COMPLETION_MAX_TOKENS
    echo_only = _completion(echo=True, max_tokens=0, logprobs=2)
    assert echo_only.echo_only
    (params,) = echo_only.sampling_params([2], 128)
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs) == (1, 2, 2)
    err = _error(lambda: _completion(max_tokens=0).sampling_params([2], 128))
    assert err.param == "max_tokens" and "0 only with 'echo': true" in err.message


def test_each_prompt_of_a_batch_is_checked_against_the_context_by_index():
    err = _error(lambda: _completion(max_tokens=10).sampling_params([5, 120, 3], 128))
    assert (err.param, err.code) == ("max_tokens", "context_length_exceeded")
    err = _error(lambda: _completion(max_tokens=10).sampling_params([5, 130], 128))
    assert err.param == "prompt[1]"
    err = _error(lambda: _completion(n=16).sampling_params([1] * 17, 128))
    assert err.param == "prompt" and "more than 256 choices" in err.message


def test_sampling_fields_are_checked_before_any_params_are_made():
    assert _error(lambda: _chat(n=0).sampling_params([1], 128)).param == "n"
    assert _error(lambda: _chat(stop=["x", ""]).sampling_params([1], 128)).param == "stop"
    assert _error(lambda: _completion(best_of=2).sampling_params([1], 128)).param == "best_of"
    assert _error(lambda: _chat(temperature=-1.0).sampling_params([1], 128)).message.startswith(
        "invalid sampling parameter")
