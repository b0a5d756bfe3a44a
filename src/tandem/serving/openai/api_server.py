"""The OpenAI-compatible HTTP app of `tandem serve`.

`create_app(client)` builds a FastAPI app over an `EngineClient`:

  POST /v1/completions, POST /v1/chat/completions   (JSON or `stream: true` Server-Sent Events)
  GET  /v1/models, GET /v1/models/{id}
  GET|HEAD /health, GET|POST /ping                  (open even with an API key)
  GET  /metrics                                     (Prometheus text; open)
  POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /version   (vLLM's; open)

Request bodies are read and validated by the endpoints rather than by FastAPI, so that every problem is
an OpenAI-shaped error (`protocol.APIError`): 400 for malformed/invalid requests, 401 for a
missing or wrong API key, 404 for an unknown model, 413 for a body over `max_request_bytes`,
429/503 for `EngineOverloadedError`/`EngineUnavailableError`, 429 for a stream over
`max_streams_per_key`, 500 for a failed generation or an unexpected exception (whose message
is not sent, and not logged unless `log_requests`).

`max_streams_per_key` caps the streaming requests open at once per client (`base.py`).

The OpenAPI schema (`/openapi.json`, `serving/openai/openapi.py`) documents the request bodies (from
the pydantic models in `protocol`) and the error statuses, so a schema-driven fuzzer exercises
the real parsing. This module assembles the app; the endpoints are `completions.py`, `chat.py`
and `tokenizer.py` over the request jobs of `generation.py` and the shared `base.ServingContext`
(limits, parsing, errors). The HTTP plumbing (errors, disconnects, SSE, middlewares) is
`asgi.py`; merging a request's engine requests, `fanout.py`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from tandem.serving.engine_client import EngineClient
from tandem.serving.metrics import ServingMetrics
from tandem.serving.openai import protocol as P
from tandem.serving.openai.asgi import AuthMiddleware, MetricsMiddleware, error_response, exception_summary
from tandem.serving.openai.base import ServingContext
from tandem.serving.openai.chat import ChatEndpoint
from tandem.serving.openai.completions import CompletionEndpoint
from tandem.serving.openai.openapi import ERROR_RESPONSES, openapi_schema, request_body
from tandem.serving.openai.tokenizer import TokenizerEndpoints

logger = logging.getLogger(__name__)


def create_app(
    client: EngineClient,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_request_bytes: int = 1_000_000,
    log_requests: bool = False,
    max_streams_per_key: int | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over `client` (see the module docstring)."""
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string (or None for no authentication)")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if max_streams_per_key is not None and max_streams_per_key < 1:
        raise ValueError(f"max_streams_per_key must be >= 1, got {max_streams_per_key}")
    served_model_name = served_model_name or client.model_name
    metrics = ServingMetrics(client, model_name=served_model_name)
    ctx = ServingContext(
        client,
        served_model_name=served_model_name,
        max_request_bytes=max_request_bytes,
        log_requests=log_requests,
        metrics=metrics,
        max_streams_per_key=max_streams_per_key,
    )
    app = FastAPI(title="tandem", summary="OpenAI-compatible MoE inference server")
    app.state.tandem = ctx
    app.state.metrics = metrics
    _add_error_handlers(app)
    _add_generation_routes(app, ctx)
    _add_model_routes(app, ctx)
    _add_tokenizer_routes(app, ctx)
    app.openapi = lambda: openapi_schema(app, ctx.served, ctx.vocab_size)  # type: ignore[method-assign]
    if api_key is not None:
        app.add_middleware(AuthMiddleware, api_key=api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: also counts 401s
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Errors FastAPI itself raises (routing, its own validation) in the OpenAI shape too."""

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(P.validation_error_to_api_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        err = P.APIError(exc.status_code, str(exc.detail), type=kind)
        return error_response(err, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.error("internal error on %s: %s", request.url.path, exception_summary(exc))
        return error_response(P.APIError(500, "internal server error", type="server_error", code="internal_error"))


def _add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    completion, chat = CompletionEndpoint(ctx), ChatEndpoint(ctx)

    @app.post("/v1/completions", openapi_extra=request_body("CompletionRequest"), responses=ERROR_RESPONSES)
    async def completions(request: Request) -> Response:
        return await ctx.guard(request, completion.handle)

    @app.post("/v1/chat/completions", openapi_extra=request_body("ChatCompletionRequest"), responses=ERROR_RESPONSES)
    async def chat_completions(request: Request) -> Response:
        return await ctx.guard(request, chat.handle)


def _add_model_routes(app: FastAPI, ctx: ServingContext) -> None:
    """The served model's card, health and metrics."""
    from tandem import __version__ as tandem_version

    def model_card() -> dict[str, Any]:
        return {"id": ctx.served, "object": "model", "created": ctx.created, "owned_by": "tandem",
                "max_model_len": ctx.client.max_model_len}

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def one_model(request: Request) -> Response:
        ctx.check_model(request.path_params["model_id"])
        return JSONResponse(model_card())

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await ctx.guard(request, list_models)

    model_id_param = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}

    @app.get("/v1/models/{model_id:path}", responses={404: ERROR_RESPONSES[404]}, openapi_extra={"parameters": [model_id_param]})
    async def model(request: Request) -> Response:
        return await ctx.guard(request, one_model)

    unavailable = {503: {"description": "The engine is unavailable (the reason is in the body)"}}

    @app.api_route("/health", methods=["GET", "HEAD"], responses=unavailable)
    async def health(request: Request) -> Response:
        return _health(ctx.client)

    @app.api_route("/ping", methods=["GET", "POST"], responses=unavailable)
    async def ping(request: Request) -> Response:
        return _health(ctx.client)

    @app.get("/version")
    async def version(request: Request) -> Response:
        return JSONResponse({"version": tandem_version})

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        content, content_type = ctx.metrics.render()
        return Response(content, headers={"Content-Type": content_type})


def _health(client: EngineClient) -> Response:
    try:
        ok, reason = client.health()
    except Exception as exc:
        ok, reason = False, f"health check failed: {type(exc).__name__}"
    if ok:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)


def _add_tokenizer_routes(app: FastAPI, ctx: ServingContext) -> None:
    endpoints = TokenizerEndpoints(ctx)

    @app.post("/tokenize", responses=ERROR_RESPONSES, openapi_extra=request_body("TokenizeRequest"))
    async def tokenize(request: Request) -> Response:
        return await ctx.guard(request, endpoints.tokenize)

    @app.post("/detokenize", responses=ERROR_RESPONSES, openapi_extra=request_body("DetokenizeRequest"))
    async def detokenize(request: Request) -> Response:
        return await ctx.guard(request, endpoints.detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        return await ctx.guard(request, endpoints.tokenizer_info)
