"""A real `tandem serve` (tiny-moe) and the official `openai` client: log-probabilities,
echo, batched prompts and vLLM's sampling extensions end to end (two DP ranks, so requests
land on both and the outputs cross the rank -> front-end queues)."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tandem.testing.server_process import Server

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow

MODEL = "tiny-moe"


@pytest.fixture(scope="module")
def server():
    with Server(MODEL, "--data-parallel-size", "2", "--kv-cache-tokens", "4096") as live:
        yield live


@pytest.fixture
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def test_completion_logprobs_streamed_and_not(oai):
    r = oai.completions.create(model=MODEL, prompt="The quick brown", max_tokens=6, temperature=0, logprobs=3,
                               extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and math.isclose(logprob, max(top.values()), abs_tol=1e-6)  # greedy: the most likely
        assert token in top and 3 <= len(top) <= 4
    streamed = {"tokens": [], "token_logprobs": []}
    for chunk in oai.completions.create(model=MODEL, prompt="The quick brown", max_tokens=6, temperature=0,
                                        logprobs=3, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            if c.logprobs:
                streamed["tokens"] += c.logprobs.tokens
                streamed["token_logprobs"] += c.logprobs.token_logprobs
    assert streamed["tokens"] == lp.tokens
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(streamed["token_logprobs"], lp.token_logprobs))


def test_chat_logprobs_and_top_logprobs(oai):
    messages = [{"role": "user", "content": "hi"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                    top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2 and item.bytes == list(item.token.encode())
        assert math.isclose(item.logprob, item.top_logprobs[0].logprob, abs_tol=1e-6)
    streamed = []
    for chunk in oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                             logprobs=True, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                streamed += c.logprobs.content
    assert [i.token for i in streamed] == [i.token for i in content]
    assert all(i.top_logprobs == [] for i in streamed)  # top_logprobs not asked: none


def test_echo_and_batched_prompts(oai):
    r = oai.completions.create(model=MODEL, prompt=["alpha", "beta"], n=2, max_tokens=3, echo=True, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text.startswith("alpha" if c.index < 2 else "beta") for c in r.choices)
    streamed = "".join(c.text for chunk in oai.completions.create(model=MODEL, prompt="gamma", max_tokens=2,
                                                                  echo=True, stream=True) for c in chunk.choices)
    assert streamed.startswith("gamma")


def _assert_legacy_logprobs_shape(lp, text: str, top: int) -> None:
    """OpenAI's legacy completions `logprobs`: one entry per token in each list, the tokens
    spelling the choice's text at their `text_offset`s, each top dict holding the token."""
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    for token, logprob, alternatives in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert logprob <= 0 and token in alternatives and alternatives[token] == logprob
        assert top <= len(alternatives) <= top + 1


def test_echo_with_logprobs_scores_the_prompt(oai):
    """echo + logprobs: the prompt's tokens lead, the first with null logprobs (nothing comes
    before it), each later one scored given the tokens before it, by the same model that
    generates: a greedy token's decode log-probability equals its score once echoed."""
    prompt = "The quick brown"
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True,
                               extra_body={"ignore_eos": True})
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(prompt) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.tokens[0] == "T"
    _assert_legacy_logprobs_shape(lp, choice.text, 2)

    generated = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                       extra_body={"ignore_eos": True}).choices[0]
    scored = oai.completions.create(model=MODEL, prompt=prompt + generated.text, max_tokens=0, logprobs=1,
                                    echo=True).choices[0]
    assert scored.text == prompt + generated.text and scored.finish_reason == "length"
    assert math.isclose(scored.logprobs.token_logprobs[-1], generated.logprobs.token_logprobs[0], abs_tol=1e-4)

    streamed = {"text": "", "tokens": [], "token_logprobs": []}
    for c in oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                    stream=True, extra_body={"ignore_eos": True}):
        for part in c.choices:
            streamed["text"] += part.text
            if part.logprobs:
                streamed["tokens"] += part.logprobs.tokens
                streamed["token_logprobs"] += part.logprobs.token_logprobs
    assert streamed["text"] == choice.text and streamed["tokens"] == lp.tokens
    assert streamed["token_logprobs"][0] is None
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(streamed["token_logprobs"][1:], lp.token_logprobs[1:]))


def test_lm_eval_loglikelihood_request_shape(oai):
    """lm-eval's loglikelihood request: a batch of token-list prompts, echo, logprobs=1,
    max_tokens=0. As vLLM answers it: each choice is its prompt alone, scored, finish
    "length", and the one token the engine sampled is counted in usage but not returned."""
    prompts = [[84, 104, 101, 32, 99, 97, 116], [65, 32, 100, 111, 103], [120, 121]]
    r = oai.completions.create(model=MODEL, prompt=prompts, max_tokens=0, logprobs=1, echo=True, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice, ids in zip(r.choices, prompts):
        assert choice.text == bytes(ids).decode() and choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
        _assert_legacy_logprobs_shape(choice.logprobs, choice.text, 1)
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == len(prompts)
    # Its continuation scored in context equals the same tokens scored as part of one prompt.
    whole = oai.completions.create(model=MODEL, prompt=prompts[0], max_tokens=0, logprobs=1, echo=True).choices[0]
    assert whole.logprobs.token_logprobs[0] is None
    assert all(math.isclose(a, b, abs_tol=1e-5)
               for a, b in zip(whole.logprobs.token_logprobs[1:], r.choices[0].logprobs.token_logprobs[1:]))
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert "'echo'" in str(info.value) and info.value.body["param"] == "max_tokens"


def test_penalties_and_min_tokens_change_what_is_generated(oai):
    base = dict(model=MODEL, prompt="aaaa", max_tokens=24, temperature=0)
    plain = oai.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    penalized = oai.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0,
                                       extra_body={"ignore_eos": True, "repetition_penalty": 1.5}).choices[0].text
    assert penalized != plain
    # Greedy with penalties is deterministic.
    again = oai.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0,
                                   extra_body={"ignore_eos": True, "repetition_penalty": 1.5}).choices[0].text
    assert again == penalized
    # min_tokens holds off the eos: at least that many tokens come back whatever the model prefers.
    r = oai.completions.create(model=MODEL, prompt="x", max_tokens=12, temperature=0, extra_body={"min_tokens": 12})
    assert r.usage.completion_tokens == 12


def test_logit_bias_forces_and_bans_tokens_as_openai_defines_it(oai):
    """tiny-moe's tokens are bytes: token 65 is "A"."""
    base = dict(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    forced = oai.completions.create(**base, logit_bias={"65": 100})
    assert forced.choices[0].text == "A" * 8
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logit_bias={"65": 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == "A" * 5
    # -100 on the token greedy decoding takes first: another one comes first instead, and a
    # request without a bias in the same server still gets the unbiased text.
    plain = oai.completions.create(**base).choices[0].text
    first = str(plain.encode()[0])
    banned = oai.completions.create(**base, logit_bias={first: -100}).choices[0].text
    assert banned.encode()[0] != plain.encode()[0]
    assert oai.completions.create(**base).choices[0].text == plain
    # Sampled (not greedy) rows take the bias too.
    sampled = oai.completions.create(**{**base, "temperature": 1.0}, seed=3, logit_bias={"66": 100})
    assert sampled.choices[0].text == "B" * 8


def test_vllm_extras_endpoints(server):
    tokens = httpx.post(f"{server.base}/tokenize", json={"prompt": "hello"}, timeout=10).json()["tokens"]
    assert httpx.post(f"{server.base}/detokenize", json={"tokens": tokens}, timeout=10).json()["prompt"].endswith("hello")
    assert httpx.head(f"{server.base}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.base}/version", timeout=10).json()["version"]
