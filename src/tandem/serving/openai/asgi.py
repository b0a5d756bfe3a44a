"""HTTP plumbing under the OpenAI app: OpenAI-shaped error responses, noticing a client
that went away (and cancelling the work done for it), Server-Sent Events whose producer stops
with the connection, and the two middlewares (request metrics, API-key check)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import traceback
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.serving.openai import protocol as P
from tandem.serving.metrics import ServingMetrics, endpoint_label

logger = logging.getLogger("tandem.serving.openai.api_server")

#: How long closing a request's engine generators may take before we log and move on.
ABORT_TIMEOUT_S = 10.0


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


def error_response(err: P.APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def exception_summary(exc: BaseException) -> str:
    """Exception type and stack, without the message (which may quote request content)."""
    frames = "".join(traceback.format_tb(exc.__traceback__))
    return f"{type(exc).__name__}\n{frames}"


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_and_wait(tasks: list[asyncio.Future], timeout: float, what: str) -> None:
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        _, still = await asyncio.wait(pending, timeout=timeout)
        if still:
            logger.warning("%d %s did not stop within %.0f s of being cancelled", len(still), what, timeout)


async def until_disconnect(receive: Receive, work: Awaitable[Any]) -> Any:
    """`await work`, unless the client disconnects first: then cancel it and raise `ClientGone`."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait([watch_task], 1.0, "disconnect watcher")
        if not work_task.done():
            await cancel_and_wait([work_task], ABORT_TIMEOUT_S, "request handler(s)")
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    raise ClientGone()


class SSEResponse(StreamingResponse):
    """Server-Sent Events whose producer is cancelled as soon as the client disconnects (we do
    not rely on a failed `send`: servers may drop writes to a closed connection silently)."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]):
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def _produce(self, send: Send) -> None:
        events = self.body_iterator
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait([watcher], 1.0, "disconnect watcher")
            await cancel_and_wait([producer], ABORT_TIMEOUT_S, "stream producer")
            await self._on_close()
        if producer.done() and not producer.cancelled() and producer.exception() is not None:
            logger.error("stream failed: %s", exception_summary(producer.exception()))


class MetricsMiddleware:
    """Counts every HTTP request by endpoint and status, and times it (streams until the end)."""

    def __init__(self, app: ASGIApp, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_and_record(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.observe_request(endpoint_label(scope["path"]), status[0], time.perf_counter() - start)


class AuthMiddleware:
    """`Authorization: Bearer <key>` on every /v1 route."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            header = dict(scope["headers"]).get(b"authorization")
            message = None
            if header is None:
                message = "missing API key: send 'Authorization: Bearer <key>'"
            else:
                scheme, _, token = header.partition(b" ")
                if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                    message = "invalid API key"
            if message is not None:
                err = P.APIError(401, message, code="invalid_api_key")
                await error_response(err, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


__all__ = [
    "ABORT_TIMEOUT_S",
    "AuthMiddleware",
    "ClientGone",
    "MetricsMiddleware",
    "SSEResponse",
    "cancel_and_wait",
    "error_response",
    "exception_summary",
    "until_disconnect",
    "wait_for_disconnect",
]
