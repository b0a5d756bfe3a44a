"""The OpenAI response shapes `tandem serve` answers with: plain dicts in the layout the OpenAI
SDK parses (whole responses, stream chunks, usage, the two `logprobs` layouts) and the
Server-Sent Event framing of a stream."""

from __future__ import annotations

import functools
import json
import secrets
import time
from typing import Any, Callable


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
