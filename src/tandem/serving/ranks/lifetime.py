"""How long a rank process lives: until the head tells it to stop, and never longer than its
parent.

A supervisor's stop signal often goes to the server's whole process group (systemd's
`KillMode=control-group`, `timeout(1)`, `kill -- -PGID`, Ctrl-C in a terminal). The ranks
ignore it: the head drains the requests in flight, then sends "shutdown", and the ranks
write their trace and exit. A head that dies without that (SIGKILL, a crash) takes its ranks
with it through the kernel's parent-death signal, so nothing is left behind.
"""

from __future__ import annotations

import os
import signal

#: The stop signals a supervisor or a terminal sends; the head drains on either.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


def ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def die_with_parent(parent_pid: int | None) -> None:
    """Linux: SIGKILL this process when its parent exits (SIGKILL: the stop signals are
    ignored). `parent_pid`: the parent this process was started by; if it already exited
    before the death signal was armed, exit now. Elsewhere a no-op: the head's shutdown
    still reaps its ranks."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # re-parented already: the head is gone


__all__ = ["STOP_SIGNALS", "die_with_parent", "ignore_stop_signals"]
