"""What every endpoint of the OpenAI front end shares (`ServingContext`): the engine client,
the served model's name, the request limits (body size, open streams per client), request
parsing and the turning of every failure into an OpenAI-shaped error.

Authentication is `asgi.AuthMiddleware`, put around the whole app by `api_server`.
`max_streams_per_key` caps the streaming requests open at once per client: per API key (the
bearer token, held only as a hash), or per client address when no key is sent.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from tandem.serving.engine_client import EngineClient, EngineOverloadedError, EngineUnavailableError
from tandem.serving.metrics import ServingMetrics
from tandem.serving.openai import protocol as P
from tandem.serving.openai import responses as R
from tandem.serving.openai.asgi import ClientGone, error_response, exception_summary
from tandem.serving.openai.chat_template import ChatFormat, ChatTemplateError

logger = logging.getLogger(__name__)

#: `Retry-After` of every 429 (seconds).
RETRY_AFTER_S = "1"


class ServingContext:
    """The state and checks every endpoint shares (`app.state.tandem`)."""

    def __init__(
        self,
        client: EngineClient,
        *,
        served_model_name: str,
        max_request_bytes: int,
        log_requests: bool,
        metrics: ServingMetrics,
        max_streams_per_key: int | None = None,
    ) -> None:
        self.client = client
        self.served = served_model_name
        self.max_request_bytes = max_request_bytes
        self.log_requests = log_requests
        self.max_streams_per_key = max_streams_per_key
        self.open_streams: dict[str, int] = {}
        self.metrics = metrics
        self.created = R.now()
        self.chat_format = ChatFormat(client)
        try:
            self.vocab_size: int | None = int(client.tokenizer.get_vocab_size(with_added_tokens=True))
        except Exception:
            self.vocab_size = None

    async def guard(self, request: Request, handler: Callable[[Request], Awaitable[Response]]) -> Response:
        """Run `handler`, turning every failure into an OpenAI-shaped error response."""
        try:
            return await handler(request)
        except P.APIError as err:
            return error_response(err, headers={"Retry-After": RETRY_AFTER_S} if err.status == 429 else None)
        except ChatTemplateError as exc:
            return error_response(P.invalid_request(str(exc), param="messages"))
        except EngineOverloadedError as exc:
            err = P.APIError(429, f"the engine is overloaded: {exc}" if str(exc) else "the engine is overloaded",
                             type="rate_limit_error", code="engine_overloaded")
            return error_response(err, headers={"Retry-After": RETRY_AFTER_S})
        except EngineUnavailableError as exc:
            err = P.APIError(503, f"the engine is unavailable: {exc}" if str(exc) else "the engine is unavailable",
                             type="server_error", code="engine_unavailable")
            return error_response(err)
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; recorded in the metrics as such
        except Exception as exc:
            if self.log_requests:
                logger.exception("internal error on %s", request.url.path)
            else:
                logger.error("internal error on %s: %s", request.url.path, exception_summary(exc))
            return error_response(P.APIError(500, "internal server error", type="server_error", code="internal_error"))

    async def read_json(self, request: Request) -> Any:
        """The decoded body, read no further than `max_request_bytes` (a 413 beyond)."""
        limit = self.max_request_bytes
        too_large = P.APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None:
            try:
                if int(length) > limit:
                    raise too_large
            except ValueError:
                raise P.invalid_request("invalid Content-Length header") from None
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
        except ClientDisconnect:
            raise ClientGone() from None  # gone while sending its body: a 499, not a 500
        return P.decode_json(bytes(body))

    def parse(self, model: type[Any], data: Any) -> Any:
        """A decoded body as `model` (unknown fields logged, then ignored)."""
        req = P.parse_request(model, data)
        ignored = P.ignored_fields(req)
        if ignored:
            logger.warning("ignoring unknown request field(s): %s", ", ".join(ignored))
        self.check_model(req.model)
        return req

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served:
            raise P.APIError(404, f"The model '{model}' does not exist; this server serves '{self.served}'",
                             param="model", code="model_not_found")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.client.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def token_text(self, token: int) -> str:
        return self.client.tokenizer.decode([token], skip_special_tokens=False)

    def check_token_ids(self, ids: list[int], param: str, what: str) -> None:
        bad = [t for t in ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            raise P.invalid_request(f"{what} {bad[0]} is out of range [0, {self.vocab_size})", param=param)

    @staticmethod
    def stream_owner(request: Request) -> str:
        """Whom a stream counts against: the API key sent (as a hash), else the client address."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return "key:" + hashlib.sha256(token.strip().encode()).hexdigest()[:32]
        return "addr:" + (request.client.host if request.client else "unknown")

    def open_stream(self, request: Request) -> Callable[[], None]:
        """Count one more open stream for the request's owner (429 over the cap); returns the
        release function, which is safe to call more than once."""
        if self.max_streams_per_key is None:
            return lambda: None
        owner = self.stream_owner(request)
        if self.open_streams.get(owner, 0) >= self.max_streams_per_key:
            raise P.APIError(
                429, f"too many concurrent streams for this API key (at most {self.max_streams_per_key}); "
                "wait for one to finish", type="rate_limit_error", code="too_many_streams",
            )
        self.open_streams[owner] = self.open_streams.get(owner, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                left = self.open_streams.get(owner, 1) - 1
                if left > 0:
                    self.open_streams[owner] = left
                else:
                    self.open_streams.pop(owner, None)

        return release
