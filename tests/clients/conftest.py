"""Real third-party clients (lm-eval, guidellm, LangChain) against a real `tandem serve` on tiny-moe.

Each client lives in its own virtualenv next to the repository (`.venv-lmeval`,
`.venv-guidellm`, `.venv-langchain`: they pull conflicting dependencies); `.ci/run` makes them and runs
`python -m pytest -m clients tests/clients`. Tests marked `clients` are skipped unless `-m`
selects them, so the default `python -m pytest` stays quick and offline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.server_process import Server

MODEL = "tiny-moe"
REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
#: No client may reach the network: datasets and tokenizers are local files.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}


def pytest_collection_modifyitems(config, items):
    if "clients" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="a real-client test: run `python -m pytest -m clients tests/clients` (.ci/run does)")
    for item in items:
        if "clients" in item.keywords:
            item.add_marker(skip)


def client_executable(venv: str, name: str) -> Path:
    """`name` from the client's own venv; the test fails (not skips) when it is missing, since
    only `-m clients` runs these tests and asking for them means the venvs should exist."""
    path = REPO / venv / "bin" / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: make the venv as .ci/run does (python3 -m venv {venv}; ...)")
    return path


@pytest.fixture(scope="session")
def server():
    with Server(MODEL, "--kv-cache-tokens", "8192") as live:
        yield live


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """tiny-moe's byte-level tokenizer as a Hugging Face tokenizer directory (what the
    clients' `AutoTokenizer.from_pretrained` reads), with nothing downloaded."""
    from tandem.models.tiny_moe import BOS_TOKEN, EOS_TOKEN, build_tokenizer

    directory = tmp_path_factory.mktemp("tiny-moe-tokenizer")
    build_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
        "model_max_length": 2048,
    }))
    return directory


def client_env() -> dict[str, str]:
    return {**os.environ, **OFFLINE_ENV}
