import subprocess
import sys

import pytest
import torch

import tandem


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tandem", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_help_works():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert "Mixture-of-Experts" in result.stdout


@pytest.mark.slow
def test_version():
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"tandem {tandem.__version__}"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_cuda_is_one_error_line():
    result = run_cli("generate", "hi", "--max-tokens", "1", "--device", "cuda")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("[tandem] error: --device cuda: CUDA is not available")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("command", [["serve", "--port", "1"], ["bench", "--tokens", "4"], ["tune"]])
def test_every_engine_command_refuses_missing_cuda_the_same_way(command):
    from typer.testing import CliRunner

    from tandem.cli import app

    result = CliRunner().invoke(app, [*command, "--device", "cuda"])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "--device cuda: CUDA is not available" in result.output


def test_device_and_dtype_flags_are_shared_by_every_engine_command():
    from typer.testing import CliRunner

    from tandem.cli import app

    for command in ("generate", "serve", "bench", "tune"):
        help_text = CliRunner().invoke(app, [command, "--help"], terminal_width=200).output
        assert "--device" in help_text and "--dtype" in help_text, command


@pytest.mark.slow  # a subprocess run
def test_serve_takes_the_model_as_an_option_as_vllm_serve_does():
    # Both forms reach the loader: the error names the directory given either way.
    for args in (["--model", "/does/not/exist"], ["/does/not/exist"], ["/does/not/exist", "--model", "/does/not/exist"]):
        result = run_cli("serve", *args, "--port", "1")
        assert result.returncode == 1, result.stderr
        assert "model path '/does/not/exist' does not exist" in result.stderr, result.stderr


@pytest.mark.slow  # a subprocess run
def test_serve_refuses_two_different_models():
    result = run_cli("serve", "tiny-moe", "--model", "small-moe", "--port", "1")
    assert result.returncode == 2, result.stderr
    assert "two models" in result.stderr and "'tiny-moe'" in result.stderr and "'small-moe'" in result.stderr, result.stderr
