"""The pipeline flags are shared engine flags: a partition that cannot fit the model, or a bad
size, is a usage error before any rank starts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tandem.cli import app


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pipeline-parallel-size", "2", "--pp-layer-partition", "1,1"], "sum to the model's 3 layers"),
        (["--pipeline-parallel-size", "4"], "fewer than the 4 pipeline stages"),
        (["--pipeline-parallel-size", "2", "--pp-async-batch-depth", "-1"], "--pp-async-batch-depth must be >= 0"),
        (["--pipeline-parallel-size", "0"], "--pipeline-parallel-size must be >= 1"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_pipeline_flags_are_usage_errors(command, flags, message):
    args = [command, "hi", *flags] if command == "generate" else [command, "tiny-moe", *flags]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split()).replace("│", "").replace("  ", " ")
