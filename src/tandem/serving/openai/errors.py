"""OpenAI-shaped errors, and the 400s a body that is not a valid request earns.

An error is `{"error": {"message", "type", "param", "code"}}` (`APIError`, `error_body`). A
body is first decoded (`decode_json`: JSON, RFC 8259's and not Python's, whose every string is
text), then validated against its request model (`parse_request`); a pydantic or FastAPI
validation error becomes one 400 naming the field (`validation_error_to_api_error`). The
request models themselves are `tandem.serving.openai.protocol`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError


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
        data = json.loads(body, parse_constant=_reject_constant)
        _check_text(data, "")
        return data
    except UnicodeDecodeError:
        raise invalid_request("malformed JSON body: not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise invalid_request(f"malformed JSON body: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise invalid_request("malformed JSON body: nested too deeply") from None


def _check_text(value: Any, path: str) -> None:
    """Every string in a decoded body is text: JSON's `\\udXXX` escapes can spell a lone
    surrogate, valid JSON but no character, which the tokenizer and every encoder refuse."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise invalid_request(
                f"invalid Unicode in '{path or 'body'}': a lone surrogate (\\u{ord(value[exc.start]):04x}) at "
                f"character {exc.start} is not text; send a complete surrogate pair or the character itself",
                param=path or None,
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path)
            _check_text(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_text(item, f"{path}[{index}]")
