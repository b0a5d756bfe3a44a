"""Run the `tandem` command line as a real subprocess (`python -m tandem ...`)."""

from __future__ import annotations

import subprocess
import sys

#: The first bytes of every PNG file (`--plot` outputs).
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem", *args], capture_output=True, text=True, timeout=timeout)
