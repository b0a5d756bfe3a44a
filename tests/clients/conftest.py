"""Real third-party clients (lm-eval, guidellm, LangChain) against a real `tandem serve` on tiny-moe.

Each client lives in its own virtualenv next to the repository (`.venv-lmeval`,
`.venv-guidellm`, `.venv-langchain`: they pull conflicting dependencies); `.ci/run` makes them and runs
`python -m pytest -m clients tests/clients`. Tests marked `clients` are skipped unless `-m`
selects them, so the default `python -m pytest` stays quick and offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.clients import MODEL
from tandem.testing.server_process import Server


def pytest_collection_modifyitems(config, items):
    if "clients" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="a real-client test: run `python -m pytest -m clients tests/clients` (.ci/run does)")
    for item in items:
        if "clients" in item.keywords:
            item.add_marker(skip)


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
