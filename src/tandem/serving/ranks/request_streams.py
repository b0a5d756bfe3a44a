"""`RequestStreams`: the front end's requests in flight, for `ProcessEngineClient`.

Each request has an asyncio queue on the event loop that asked for it and the DP rank that
serves it; the count per rank routes a new request to the rank with the fewest in flight.
Event loops open and close streams while the pump thread delivers outputs, so every change
holds one lock, and a stream's queue is only ever fed through its own loop.
"""

from __future__ import annotations

import asyncio
import threading

from tandem.engine.outputs import RequestOutput
from tandem.serving.engine_client import EngineOverloadedError


class RequestStreams:
    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop, int]] = {}
        self._in_flight = [0] * num_ranks
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def in_flight(self) -> list[int]:
        """Requests in flight per rank."""
        return list(self._in_flight)

    def open(self, request_id: str, max_queue_len: int | None) -> tuple[asyncio.Queue, int]:
        """A stream for `request_id` on the running event loop, and the rank with the fewest
        requests in flight, which serves it."""
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            if max_queue_len is not None and sum(self._in_flight) >= max_queue_len:
                raise EngineOverloadedError(
                    f"the server is at capacity ({max_queue_len} requests in flight); retry later"
                )
            rank = min(range(self.num_ranks), key=lambda r: self._in_flight[r])
            self._in_flight[rank] += 1
            self._streams[request_id] = (stream, loop, rank)
        return stream, rank

    def close(self, request_id: str) -> int | None:
        """Forget `request_id`; the rank that served it, or None where it had already ended."""
        with self._lock:
            entry = self._streams.pop(request_id, None)
            if entry is None:
                return None
            self._in_flight[entry[2]] -= 1
        return entry[2]

    def deliver(self, output: RequestOutput) -> None:
        """Hand `output` to its request's stream (from any thread); the last one closes it."""
        with self._lock:
            entry = self._streams.get(output.request_id)
            if entry is None:
                return  # the client already left
            stream, loop, rank = entry
            output.engine_index = rank
            if output.finished:
                del self._streams[output.request_id]
                self._in_flight[rank] -= 1
        loop.call_soon_threadsafe(stream.put_nowait, output)

    def fail_all(self, message: str) -> None:
        """End every request in flight with `message` as its error."""
        with self._lock:
            entries = list(self._streams.items())
            self._streams.clear()
            self._in_flight = [0] * self.num_ranks
        for request_id, (stream, loop, _) in entries:
            output = RequestOutput.failed(request_id, message)
            try:
                loop.call_soon_threadsafe(stream.put_nowait, output)
            except RuntimeError:
                pass  # that request's event loop is gone


__all__ = ["RequestStreams"]
