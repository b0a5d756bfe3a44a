"""The app's OpenAPI schema (`/openapi.json`): FastAPI's, plus the request bodies the
handlers parse themselves and the limits they enforce beyond the pydantic types, so a
schema-driven fuzzer exercises the real parsing."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from tandem.serving.openai import protocol as P


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid request (malformed JSON, unknown field, wrong type, bad value, over the context length)"},
    401: {"description": "Missing or invalid API key"},
    404: {"description": "Unknown model"},
    413: {"description": "Request body over the size limit"},
    429: {"description": "Engine queue full, or too many concurrent streams for this API key"},
    500: {"description": "Generation failed"},
    503: {"description": "The engine is unavailable"},
}


def request_body(model: str) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


# Limits the handlers enforce beyond the pydantic types, documented in the schema (the
# errors stay the handlers' own): the non-null member of each field gets these keywords.
_DOCUMENTED_LIMITS: dict[str, dict[str, Any]] = {
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},
    "n": {"minimum": 1, "maximum": P.MAX_N},
    "seed": {"minimum": P.MIN_SEED, "maximum": P.MAX_SEED},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "min_p": {"minimum": 0, "maximum": 1},
    "min_tokens": {"minimum": 0},
    "best_of": {"minimum": 1, "maximum": P.MAX_N},
    "logit_bias": {
        "propertyNames": {"pattern": "^[0-9]+$"}, "maxProperties": P.MAX_LOGIT_BIAS,
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    },
    "stop_token_ids": {"items": {"type": "integer", "minimum": 0}},
    "messages": {"minItems": 1},
}
# Accepted only at their default value (asking for more is a 400 "not supported").
_DEFAULT_ONLY = {"logprobs", "echo", "suffix", "top_logprobs"}


def _document_limits(body: dict[str, Any], vocab_size: int | None) -> None:
    if "messages" in body["properties"]:
        body.setdefault("required", []).append("messages")
    for name, prop in body["properties"].items():
        if name in _DEFAULT_ONLY:
            body["properties"][name] = {"type": "null", "title": prop.get("title", name)}
            continue
        members = [m for m in prop.get("anyOf", [prop]) if m.get("type") != "null"]
        for member in members:
            member.update(_DOCUMENTED_LIMITS.get(name, {}))
            if member.get("type") == "string" and name in ("prompt", "stop"):
                member["minLength"] = 1
            if member.get("type") != "array" or name not in ("prompt", "stop"):
                continue
            items = member.get("items", {})
            if items.get("type") == "string":
                items["minLength"] = 1
            token_ids = items if items.get("type") == "integer" else items.get("items", {})
            if token_ids.get("type") == "integer":
                token_ids["minimum"] = 0
                if vocab_size is not None:
                    token_ids["maximum"] = vocab_size - 1
            if name == "prompt":
                if items.get("type") == "integer":
                    member["minItems"] = 1
                else:
                    member.update(minItems=1)  # a batch of prompts
                    if items.get("type") == "array":
                        items["minItems"] = 1


def openapi_schema(app: FastAPI, served_model_name: str, vocab_size: int | None) -> dict[str, Any]:
    """FastAPI's schema plus the request bodies the handlers parse themselves."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (P.CompletionRequest, P.ChatCompletionRequest):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        # This server serves exactly one model.
        body["properties"]["model"] = {"type": "string", "enum": [served_model_name], "title": "Model"}
        _document_limits(body, vocab_size)
        components[model.__name__] = body
    for model in (P.TokenizeCompletionRequest, P.TokenizeChatRequest, P.DetokenizeRequest):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        body["properties"]["model"] = {"type": "string", "enum": [served_model_name], "title": "Model"}
        components[model.__name__] = body
    components["TokenizeRequest"] = {"anyOf": [{"$ref": "#/components/schemas/TokenizeCompletionRequest"},
                                               {"$ref": "#/components/schemas/TokenizeChatRequest"}]}
    app.openapi_schema = schema
    return schema


__all__ = ["ERROR_RESPONSES", "openapi_schema", "request_body"]
