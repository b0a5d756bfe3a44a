"""OpenAI-compatible request and response shapes for `tandem serve`.

Requests are pydantic v2 models in strict mode with unknown fields forbidden: a field this
server does not know is a 400 naming it, never silently ignored. A few fields the OpenAI SDK
and common tools send are accepted as long as they ask for the default behaviour
(`user`, `presence_penalty`/`frequency_penalty` of 0, an empty `logit_bias`, `echo` false,
`suffix` null, `best_of` 1); asking for anything else from them is a 400 saying it is not
supported.

Extensions beyond the OpenAI API: `top_k` (0 or -1: no cut), `stop_token_ids`, `ignore_eos`.

`response_format` (both endpoints) and chat `tools` / `tool_choice` / `parallel_tool_calls`
are checked and turned into constraints by `tandem.serving.openai.structured`.

Responses are plain dicts built by the `*_response` / `*_chunk` helpers here, in the
layout the OpenAI SDK parses. Errors are `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import functools
import json
import secrets
import time
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

#: Most choices one request may fan out to (`n`).
MAX_N = 16
#: Most choices of one request over a batch of prompts (prompts x n).
MAX_CHOICES = 256
#: `max_tokens` default of `/v1/completions` (as in the OpenAI API).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Seeds are 64-bit signed integers (room left for the `seed + i` of `n > 1`).
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1 - MAX_N


# --------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered to the client as an OpenAI-shaped JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# Fields whose pydantic union errors are unreadable; say what is expected instead.
_EXPECTED = {
    "prompt": "a string, a list of one string, or a list of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "literal"}


def _clean_loc(loc: tuple[Any, ...]) -> list[str]:
    """Drop pydantic's union-member tags (`str`, `list[int]`, ...) from an error location."""
    out = []
    for part in loc:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif isinstance(part, str) and ("[" in part or part.lower() in _TYPE_TAGS):
            continue
        else:
            out.append(str(part))
    return out


def _join_loc(parts: list[str]) -> str:
    text = ""
    for part in parts:
        text += part if part.startswith("[") or not text else "." + part
    return text


def validation_error_to_api_error(errors: list[dict[str, Any]]) -> APIError:
    """The first problem of a pydantic/FastAPI validation error as a 400 naming the field."""
    if not errors:
        return invalid_request("invalid request")
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header"):  # FastAPI's RequestValidationError
        loc = loc[1:]
    parts = _clean_loc(loc)
    name = _join_loc(parts) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return invalid_request(f"unknown field '{name}': this server does not accept it", param=name)
    if kind == "missing":
        return invalid_request(f"missing required field '{name}'", param=name)
    if kind == "json_invalid":
        return invalid_request(f"malformed JSON body: {first.get('msg', '')}")
    field = parts[-1] if parts else None
    # A union field fails once per member; name what is expected instead of listing them.
    if field in _EXPECTED and sum(1 for e in errors if _clean_loc(tuple(e.get("loc", ()))) == parts) > 1:
        return invalid_request(f"'{name}' must be {_EXPECTED[field]}", param=name)
    return invalid_request(f"'{name}': {first.get('msg', 'invalid value')}", param=name)


def parse_request(model: type[BaseModel], data: Any) -> Any:
    """Validate a decoded JSON body; any problem is a 400 `APIError`."""
    if not isinstance(data, dict):
        raise invalid_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error_to_api_error(exc.errors(include_url=False, include_input=False)) from None


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN / Infinity / -Infinity; JSON (RFC 8259) does not.
    raise invalid_request(f"malformed JSON body: {name} is not a JSON value")


def decode_json(body: bytes) -> Any:
    if not body.strip():
        raise invalid_request("the request body is empty; send a JSON object")
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise invalid_request("malformed JSON body: not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise invalid_request(f"malformed JSON body: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise invalid_request("malformed JSON body: nested too deeply") from None


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

    def check_unsupported(self) -> None:
        pass


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    logprobs: Int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: Int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix is not None:
            raise invalid_request("'suffix' is not supported by this server (no fill-in-the-middle)", param="suffix")


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


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # No prefix cache yet: no prompt token is ever served from the cache.
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


#: Per generated token: [(id, logprob)] of the sampled token, then of the most likely ones.
TokenLogprobs = list[list[tuple[int, float]]]


def completion_logprobs(entries: TokenLogprobs, token_text: Callable[[int], str], offset: int,
                        first_prompt_token: int | None = None) -> dict[str, Any]:
    """The legacy completions `logprobs` object; `offset` is the first token's `text_offset`.
    As vLLM does, each `top_logprobs` dict holds the sampled token too. `first_prompt_token`
    (echo): the prompt's first token leads, with null `token_logprobs` and `top_logprobs`
    (nothing precedes it), and `entries` continue from the prompt's second token."""
    ids = [entry[0][0] for entry in entries]
    token_logprobs: list[float | None] = [entry[0][1] for entry in entries]
    top_logprobs: list[dict[str, float] | None] = [
        {token_text(t): lp for t, lp in [*entry[1:], entry[0]]} for entry in entries
    ]
    if first_prompt_token is not None:
        ids.insert(0, first_prompt_token)
        token_logprobs.insert(0, None)
        top_logprobs.insert(0, None)
    tokens, offsets = [], []
    for token in ids:
        text = token_text(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(entries: TokenLogprobs, token_text: Callable[[int], str]) -> dict[str, Any]:
    """The chat `logprobs` object: `content` per token, `top_logprobs` the requested alternatives."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**item(*entry[0]), "top_logprobs": [item(*alt) for alt in entry[1:]]} for entry in entries],
        "refusal": None,
    }


def completion_response(
    request_id: str, created: int, model: str, choices: list[tuple[str, str | None]], usage_: dict[str, int],
    logprobs: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """`choices`: (text, finish_reason) per index; `logprobs`: each choice's logprobs object."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": i, "text": text, "logprobs": logprobs[i] if logprobs else None, "finish_reason": reason}
            for i, (text, reason) in enumerate(choices)
        ],
        "usage": usage_,
        "system_fingerprint": None,
    }


def chat_response(
    request_id: str, created: int, model: str, choices: list[tuple[str, str | None]], usage_: dict[str, int],
    logprobs: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs[i] if logprobs else None,
                "finish_reason": reason,
            }
            for i, (text, reason) in enumerate(choices)
        ],
        "usage": usage_,
        "system_fingerprint": None,
    }


def _stream_chunk(
    object_name: str,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage_: dict[str, int] | None = None,
    with_usage_field: bool = False,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": [{"logprobs": None, **c} for c in choices],
    }
    if with_usage_field or usage_ is not None:
        chunk["usage"] = usage_
    return chunk


#: `choices` of a completion chunk: dicts with `index`, `text`, `finish_reason`.
completion_chunk = functools.partial(_stream_chunk, "text_completion")
#: `choices` of a chat chunk: dicts with `index`, `delta`, `finish_reason`.
chat_chunk = functools.partial(_stream_chunk, "chat.completion.chunk")


def sse(data: dict[str, Any] | str) -> bytes:
    """One Server-Sent Event carrying `data` (a dict is sent as JSON)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
