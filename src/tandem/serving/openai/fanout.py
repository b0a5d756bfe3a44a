"""One HTTP request's `n` x prompts engine requests, merged into one stream of
(choice index, output): a pump task per engine request feeds one queue; closing it aborts
every engine request still running."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from tandem.engine.outputs import RequestOutput
from tandem.worker.sampling import SamplingParams
from tandem.serving.openai import protocol as P
from tandem.serving.openai.asgi import ABORT_TIMEOUT_S, cancel_and_wait
from tandem.serving.engine_client import EngineClient
from tandem.serving.vllm_metrics import RequestTracker


class RequestFanout:
    """The `n` engine requests of one HTTP request, merged into one stream of (index, output)."""

    def __init__(self, client: EngineClient, request_id: str, prompts: list[list[int]], params: list[SamplingParams],
                 trackers: list[RequestTracker]):
        self.n = len(params)
        self._queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._finished = 0
        self._tasks = [
            asyncio.ensure_future(self._pump(client, i, f"{request_id}-{i}", prompt_ids, p, tracker))
            for i, (prompt_ids, p, tracker) in enumerate(zip(prompts, params, trackers))
        ]

    async def _pump(self, client: EngineClient, i: int, rid: str, prompt_ids: list[int], params: SamplingParams,
                    tracker: RequestTracker):
        """Every output is observed here as it arrives, however fast the HTTP side consumes it."""
        gen = None
        try:
            gen = client.generate(rid, list(prompt_ids), params)
            async for out in gen:
                tracker.observe(out)
                self._queue.put_nowait((i, out, None))
                if out.finished:
                    return
            self._queue.put_nowait((i, None, RuntimeError(f"the engine ended request {rid} without a final output")))
        except asyncio.CancelledError:
            tracker.abandoned()
            raise
        except Exception as exc:
            self._queue.put_nowait((i, None, exc))
        finally:
            aclose = getattr(gen, "aclose", None)
            if aclose is not None:
                await aclose()  # aborts the request in the engine unless it finished

    async def _next(self) -> tuple[int, RequestOutput]:
        i, out, err = await self._queue.get()
        if err is not None:
            raise err
        assert out is not None
        if out.finished:
            self._finished += 1
        return i, out

    async def prime(self) -> None:
        """Wait until every engine request produced its first output (so was admitted); an
        engine error raised before that propagates here."""
        seen: set[int] = set()
        while len(seen) < self.n:
            i, out = await self._next()
            if out.finished and out.finish_reason == "error":
                raise P.APIError(500, f"generation failed: {out.error or 'engine error'}", type="server_error",
                                 code="generation_error")
            self._buffer.append((i, out))
            seen.add(i)

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._buffer:
            yield self._buffer.pop(0)
        while self._finished < self.n:
            yield await self._next()

    async def aclose(self) -> None:
        await cancel_and_wait(self._tasks, ABORT_TIMEOUT_S, "engine request(s)")


__all__ = ["RequestFanout"]
