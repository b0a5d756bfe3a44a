"""LangChain (`langchain-openai`, its own venv `.venv-langchain`) against a real `tandem serve`:
`with_structured_output` by JSON schema and by function calling, and `bind_tools` with a named
and a required tool choice, streamed too. With the random tiny model the words are noise, but
every reply must parse into the schema LangChain asked for."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.clients import client_env, client_executable

pytestmark = pytest.mark.clients

SCRIPT = Path(__file__).resolve().parent / "scripts" / "langchain_calls.py"
CITIES = {"Paris", "Oslo", "Lima"}


def _valid_trip(args: dict) -> bool:
    return set(args) == {"city", "by_train"} and args["city"] in CITIES and isinstance(args["by_train"], bool)


def test_langchain_structured_output_and_tool_binding(server):
    python = client_executable(".venv-langchain", "python")
    done = subprocess.run([str(python), str(SCRIPT), server.base], env=client_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"langchain failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert _valid_trip(out["json_schema"]) and _valid_trip(out["function_calling"])
    for choice in ("named", "required", "required_streamed"):
        calls = out[choice]
        assert len(calls) == 1 and calls[0]["name"] == "book" and _valid_trip(calls[0]["args"]), (choice, calls)
