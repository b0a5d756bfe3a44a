"""Start `tandem serve` (or torchrun ranks running it) as real subprocesses for tests,
with every wait bounded and every process reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

import httpx

from tandem.distributed.launch import find_free_port


def wait_ready(
    url: str,
    timeout_s: float,
    procs: list[subprocess.Popen],
    *,
    what: str = "server process",
    detail: Callable[[], str] = lambda: "",
    interval_s: float = 0.2,
) -> None:
    """Poll `url` until it answers 200. Raises RuntimeError as soon as one of `procs` (the
    server's processes) exits, TimeoutError when `timeout_s` runs out; `detail()` (say, the
    tail of the server's log) ends both messages."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited early with code {proc.returncode}{_suffix(detail)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g} s{_suffix(detail)}")


def _suffix(detail: Callable[[], str]) -> str:
    text = detail()
    return f":\n{text}" if text else ""


def wait_healthy(base: str, timeout_s: float, procs: list[subprocess.Popen]) -> None:
    wait_ready(f"{base}/health", timeout_s, procs)


def rank_pids(parent_pids: list[int]) -> list[int]:
    """Live descendants of the given processes (the rank and front-end processes)."""
    found, frontier = [], list(parent_pids)
    while frontier:
        pid = frontier.pop()
        try:
            children = subprocess.run(
                ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, timeout=10
            ).stdout.split()
        except subprocess.TimeoutExpired:
            children = []
        for child in map(int, children):
            found.append(child)
            frontier.append(child)
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def session_id(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # Fields after the command name, which may hold spaces: state ppid pgrp session ...
            return int(f.read().rpartition(")")[2].split()[3])
    except OSError:
        return None


def session_pids(session_id: int) -> list[int]:
    """Live processes of a session (the server started with `start_new_session`: every process
    it or its ranks started, unless one left the session on purpose)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # Fields after the command name, which may hold spaces: state ppid pgrp session ...
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == session_id:
            found.append(int(entry))
    return found


class Server:
    """`tandem serve ARGS` on a free loopback port, in a session of its own (its pid is the
    session and process-group id); `stop()` sends SIGINT like Ctrl-C."""

    def __init__(self, *args: str, startup_timeout_s: float = 180.0, env: dict | None = None,
                 torchrun_nproc: int | None = None):
        """`torchrun_nproc`: run under torchrun, that many ranks on this host (loopback)."""
        self.port = find_free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        launcher = [sys.executable, "-m"]
        if torchrun_nproc is not None:
            launcher += ["torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(torchrun_nproc),
                         "--master-addr", "127.0.0.1", "--master-port", str(find_free_port()), "-m"]
        self.proc = subprocess.Popen(
            [*launcher, "tandem", "serve", *args, "--port", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # a test's Ctrl-C goes only where the test sends it
        )
        try:
            wait_healthy(self.base, startup_timeout_s, [self.proc])
        except BaseException:
            self.kill()
            raise
        self.children = rank_pids([self.proc.pid])
        # torchrun starts each rank in a session of its own.
        self.sessions = {self.proc.pid} | {sid for sid in map(session_id, self.children) if sid is not None}

    def leftover(self, timeout_s: float = 10.0) -> list[int]:
        """Processes of the server's sessions still alive after up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (left := [pid for sid in self.sessions for pid in session_pids(sid)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    @property
    def url(self) -> str:
        return f"{self.base}/v1"

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def send(self, sig: signal.Signals, *, group: bool = False) -> None:
        """`sig` to the head alone, or (`group`) to every process of its group, as systemd's
        `KillMode=control-group`, `timeout(1)` and `kill -- -PGID` do."""
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 45.0, sig: signal.Signals = signal.SIGINT, *, group: bool = False) -> int:
        if self.proc.poll() is None:
            self.send(sig, group=group)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL whatever is left of the server's session."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        for pid in [pid for sid in getattr(self, "sessions", {self.proc.pid}) for pid in session_pids(sid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self.kill()


# ------------------------------------------------------------------ checks against a running server


def complete(server: Server, prompt: str, max_tokens: int, timeout: float = 60, **extra) -> httpx.Response:
    body = {"model": "tiny-moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.url}/completions", json={**body, **extra}, timeout=timeout)


def get_health(server: Server) -> httpx.Response:
    return httpx.get(f"{server.base}/health", timeout=10)


def wait_unhealthy(server: Server, timeout_s: float) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        response = get_health(server)
        if response.status_code != 200:
            return response, time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"/health stayed 200 for {timeout_s:g} s")


def stop_and_check_no_orphans(server: Server) -> None:
    children = server.children
    started = time.monotonic()
    assert server.stop(timeout_s=30) in (0, 130)
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 5
    while [pid for pid in children if pid_alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in children if pid_alive(pid)] == []
