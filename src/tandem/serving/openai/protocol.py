"""OpenAI-compatible request and response shapes for `tandem serve`.

Requests are pydantic v2 models in strict mode with unknown fields forbidden: a field this
server does not know is a 400 naming it, never silently ignored. A few fields the OpenAI SDK
and common tools send are accepted as long as they ask for the default behaviour
(`user`, `echo` false, `suffix` null, `best_of` 1); asking for anything else from them is a
400 saying it is not supported. `logit_bias` is OpenAI's: token ids (as strings) mapped to
values in [-100, 100], at most `MAX_LOGIT_BIAS` of them; ids past the vocabulary are refused.

Extensions beyond the OpenAI API: `top_k` (0 or -1: no cut), `stop_token_ids`, `ignore_eos`.

`response_format` (both endpoints) and chat `tools` / `tool_choice` / `parallel_tool_calls`
are checked and turned into constraints by `tandem.serving.openai.structured`.

Each generation request builds its own `SamplingParams` (`sampling_params`): every limit
(`max_tokens`, `n`, the context length, ...) is checked there, once, for both endpoints.

Errors are `{"error": {"message", "type", "param", "code"}}`, built and raised by
`tandem.serving.openai.errors` (re-exported here: `APIError`, `invalid_request`, `parse_request`,
...); the response shapes are `tandem.serving.openai.responses`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

# Re-exported: the endpoints, the app and tests reach the errors as `P.APIError`, `P.parse_request`, ...
from tandem.serving.openai.errors import (  # noqa: F401
    APIError,
    decode_json,
    error_body,
    invalid_request,
    parse_request,
    validation_error_to_api_error,
)
from tandem.worker.sampling import SamplingParams

#: Most choices one request may fan out to (`n`).
MAX_N = 16
#: Most choices of one request over a batch of prompts (prompts x n).
MAX_CHOICES = 256
#: Most `logit_bias` entries one request may carry (OpenAI's limit).
MAX_LOGIT_BIAS = 300
#: `max_tokens` default of `/v1/completions` (as in the OpenAI API).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Seeds are 64-bit signed integers (room left for the `seed + i` of `n > 1`).
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1 - MAX_N


# --------------------------------------------------------------------------- requests


def _integral_float_to_int(value: Any) -> Any:
    # vLLM (lax pydantic) takes `max_tokens: 16.0`; a fractional value stays an error.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: An integer field that also takes an integral float (`16.0`), as vLLM does.
Int = Annotated[int, BeforeValidator(_integral_float_to_int)]


class _Strict(BaseModel):
    """Unknown fields are a 400: used where a misspelt key would silently change the prompt."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Lenient(BaseModel):
    """Unknown fields are accepted and ignored, as vLLM does; `ignored_fields` names them so
    the server can log a warning."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the unknown fields a `_Lenient` request (and its nested models) carried."""
    names = [prefix + name for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            names += ignored_fields(value, f"{prefix}{name}.")
    return names


class StreamOptions(_Lenient):
    include_usage: bool | None = None
    #: vLLM: usage (so far) in every chunk, not only in the last one.
    continuous_usage_stats: bool | None = None


class _SamplingRequest(_Lenient):
    #: Optional: this server serves one model (vLLM's default).
    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    n: Int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: Int | None = None  # 0 or -1: no cut
    min_p: float | None = None
    min_tokens: Int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool | None = None
    # `text`, `json_object` or `json_schema` (tandem.serving.openai.structured checks the rest).
    response_format: dict[str, Any] | None = None

    #: Appended to the error for a budget below 1 (what the endpoint allows instead).
    max_tokens_hint: ClassVar[str] = ""

    def check_fields(self) -> None:
        """Rules over the fields that their types do not say (what is unsupported, what needs what)."""

    def requested_max_tokens(self, longest_prompt: int, max_model_len: int) -> tuple[int, str]:
        """The generation budget asked for, and the field that asked for it."""
        raise NotImplementedError

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """Alternatives to return per generated and per prompt token (None: no log-probabilities)."""
        return None, None

    def prompt_param(self, index: int, num_prompts: int) -> str:
        """The field an error about prompt `index` (of `num_prompts`) names."""
        raise NotImplementedError

    def sampling_params(self, prompt_lens: list[int], max_model_len: int,
                        json_schema: str | None = None) -> list[SamplingParams]:
        """The `n` choices' parameters (seed `seed + i` for choice i), shared by every prompt of
        the request (`prompt_lens`: their token counts). Every limit is checked here, once."""
        max_tokens, max_tokens_param = self.requested_max_tokens(max(prompt_lens), max_model_len)
        if max_tokens < 1:
            raise invalid_request(f"'{max_tokens_param}' must be at least 1, got {max_tokens}{self.max_tokens_hint}",
                                  param=max_tokens_param)
        n = self._checked_n()
        self._check_sampling_fields(n)
        logit_bias = self._logit_bias()
        if len(prompt_lens) * n > MAX_CHOICES:
            raise invalid_request(f"{len(prompt_lens)} prompts x n={n} is more than {MAX_CHOICES} choices "
                                  "in one request", param="prompt")
        for i, num_prompt in enumerate(prompt_lens):
            check_context(num_prompt, max_tokens, max_model_len, self.prompt_param(i, len(prompt_lens)),
                          max_tokens_param)
        return [self._choice_params(i, max_tokens, json_schema, logit_bias) for i in range(n)]

    def _checked_n(self) -> int:
        n = 1 if self.n is None else self.n
        if not 1 <= n <= MAX_N:
            raise invalid_request(f"'n' must be between 1 and {MAX_N}, got {n}", param="n")
        return n

    def _check_sampling_fields(self, n: int) -> None:
        if any(s == "" for s in self._stop_strings()):
            raise invalid_request("'stop' strings must be non-empty", param="stop")
        if any(t < 0 for t in self.stop_token_ids or []):
            raise invalid_request("'stop_token_ids' must be non-negative token ids", param="stop_token_ids")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise invalid_request(f"'seed' must be a 64-bit integer in [{MIN_SEED}, {MAX_SEED}]", param="seed")
        best_of = getattr(self, "best_of", None)
        if best_of is not None and best_of != n:
            # best_of > n ranks candidates by cumulative log-probability; vLLM's V1 engine refuses it too.
            raise invalid_request(f"'best_of' must equal 'n' ({n}) on this server, got {best_of}", param="best_of")

    def _logit_bias(self) -> dict[int, float] | None:
        """`logit_bias` with its keys as token ids (the values' range is `SamplingParams`'s
        check, the vocabulary bound the endpoint's: `GenerationEndpoint.new_job`)."""
        if not self.logit_bias:
            return None
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise invalid_request(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}",
                                  param="logit_bias")
        bad = next((key for key in self.logit_bias if not (key.isascii() and key.isdigit())), None)
        if bad is not None:
            raise invalid_request(f"'logit_bias' keys must be token ids (decimal integers), got {bad!r}",
                                  param="logit_bias")
        return {int(key): float(bias) for key, bias in self.logit_bias.items()}

    def _stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def _choice_params(self, choice: int, max_tokens: int, json_schema: str | None,
                       logit_bias: dict[int, float] | None) -> SamplingParams:
        logprobs, prompt_logprobs = self.logprob_counts()
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k in (None, -1) else self.top_k,
                min_p=self.min_p or 0.0,
                seed=None if self.seed is None else self.seed + choice,
                stop=self._stop_strings(),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=bool(self.ignore_eos),
                min_tokens=self.min_tokens or 0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                frequency_penalty=self.frequency_penalty or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                json_schema=json_schema,
                logit_bias=logit_bias,
            )
        except ValueError as exc:
            name = str(exc).split()[0] if str(exc) else None
            raise invalid_request(f"invalid sampling parameter: {exc}", param=name) from None


def check_context(num_prompt: int, max_tokens: int, max_model_len: int, prompt_param: str,
                  max_tokens_param: str) -> None:
    """A prompt and its generation budget must fit the model's context."""
    if num_prompt + max_tokens > max_model_len:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens, but the request needs "
            f"{num_prompt + max_tokens} ({num_prompt} in the prompt + {max_tokens} for '{max_tokens_param}'). "
            f"Shorten the prompt or lower '{max_tokens_param}'.",
            param=prompt_param if num_prompt >= max_model_len else max_tokens_param,
            code="context_length_exceeded",
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    logprobs: Int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: Int | None = None

    def check_fields(self) -> None:
        super().check_fields()
        if self.suffix is not None:
            raise invalid_request("'suffix' is not supported by this server (no fill-in-the-middle)", param="suffix")

    max_tokens_hint: ClassVar[str] = " (0 only with 'echo': true, which returns the prompt)"

    @property
    def echo_only(self) -> bool:
        """As vLLM (and OpenAI's legacy API): `echo` with `max_tokens` 0 returns the prompt alone
        (its log-probabilities, lm-eval's loglikelihood request); the engine still samples one
        token, which is dropped but counted in usage, as vLLM counts it."""
        return bool(self.echo) and self.max_tokens == 0

    def requested_max_tokens(self, longest_prompt: int, max_model_len: int) -> tuple[int, str]:
        if self.echo_only:
            return 1, "max_tokens"
        return (DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens), "max_tokens"

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def prompt_param(self, index: int, num_prompts: int) -> str:
        return "prompt" if num_prompts == 1 else f"prompt[{index}]"


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string or a list of {"type": "text", "text": ...} parts (checked by `render_chat`).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # Passed to the chat template, which renders them (a tool-calling conversation's history).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(default_factory=list)
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    # vLLM's extensions: extra variables for the chat template (e.g. `enable_thinking`).
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    # Tools: rendered into the prompt by the chat template; `tool_choice` says whether the
    # reply is parsed for calls (auto) or constrained to one (required, named).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_fields(self) -> None:
        super().check_fields()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if not self.messages:
            raise invalid_request("'messages' must contain at least one message", param="messages")

    def requested_max_tokens(self, longest_prompt: int, max_model_len: int) -> tuple[int, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        if self.max_tokens is not None:
            return self.max_tokens, "max_tokens"
        # The rest of the context; a prompt that fills it still asks for one token, so that the
        # context check names the prompt.
        return max(1, max_model_len - longest_prompt), "max_tokens"

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return ((self.top_logprobs or 0) if self.logprobs else None), None

    def prompt_param(self, index: int, num_prompts: int) -> str:
        return "messages"


class TokenizeCompletionRequest(_Lenient):
    """vLLM's `/tokenize` with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Lenient):
    """vLLM's `/tokenize` with chat messages (rendered by the chat template first)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = None
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[Int]
