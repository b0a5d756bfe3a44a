"""How `tandem serve` stops: SIGTERM and SIGINT, sent to the head or to its whole process
group, drain the server the same way.

The first signal starts the drain: `/health` and every new request answer 503, the requests
in flight go on until they finish or `--shutdown-timeout` passes (then each ends with an
error its client sees), and only then does the HTTP server close and the ranks get their
"shutdown" (they write `--trace` and exit). The rank processes ignore both signals, so a
signal to the whole group reaches the head alone in effect. A second signal during the drain
ends the remaining requests with an error and stops at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Callable, Generator

import uvicorn

from tandem.serving.ranks.lifetime import STOP_SIGNALS


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains the engine client before it stops listening.

    `client` needs `begin_drain()`, `num_in_flight` and `end_drain(message)` (the
    `ProcessEngineClient`). The signal handler only records the signal; the drain's steps run
    on the event loop, in `on_tick` (every 0.1 s), where they may take the client's locks."""

    def __init__(self, config: uvicorn.Config, client, drain_timeout_s: float, log: Callable[[str], None]):
        super().__init__(config)
        self.client = client
        self.drain_timeout_s = drain_timeout_s
        self.log = log
        self.signals_received: list[int] = []
        self._drain_deadline: float | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Unlike uvicorn's own, this does not re-raise the signal once the server has stopped:
        # a drained stop is a clean exit (code 0), and the caller still has the ranks to stop.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        self.signals_received.append(sig)
        if len(self.signals_received) > 1:
            self.should_exit = True
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.signals_received and not self.should_exit:
            self._advance_drain()
        return await super().on_tick(counter)

    def _advance_drain(self) -> None:
        now = time.monotonic()
        if self._drain_deadline is None:
            self._drain_deadline = now + self.drain_timeout_s
            self.client.begin_drain()
            name = signal.Signals(self.signals_received[0]).name
            self.log(f"{name}: draining: new requests get 503, {self.client.num_in_flight} in flight get up to "
                     f"{self.drain_timeout_s:g} s (--shutdown-timeout); a second signal stops at once")
        if self.client.num_in_flight == 0:
            self.should_exit = True
        elif now >= self._drain_deadline:
            left = self.client.num_in_flight
            self.client.end_drain(f"the server shut down before this request finished (--shutdown-timeout "
                                  f"{self.drain_timeout_s:g} s)")
            self.log(f"drain deadline passed: {left} request(s) ended with an error")
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        if self.force_exit:
            self.client.begin_drain()
            self.client.end_drain("the server was stopped (a second stop signal) before this request finished")
            self.log("second stop signal: stopping now")
        await super().shutdown(sockets=sockets)


__all__ = ["DrainingServer"]
