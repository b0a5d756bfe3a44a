"""Where the real-client tests (tests/clients) find their clients: each in its own virtualenv
next to the repository, run offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MODEL = "tiny-moe"
REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "clients" / "data"
#: No client may reach the network: datasets and tokenizers are local files.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}


def client_executable(venv: str, name: str) -> Path:
    """`name` from the client's own venv; the test fails (not skips) when it is missing, since
    only `-m clients` runs these tests and asking for them means the venvs should exist."""
    path = REPO / venv / "bin" / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: make the venv as .ci/run does (python3 -m venv {venv}; ...)")
    return path


def client_env() -> dict[str, str]:
    return {**os.environ, **OFFLINE_ENV}
