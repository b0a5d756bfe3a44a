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


AUTO_DP2 = ["--data-parallel-size", "2", "--enable-dbo", "--overlap-policy", "auto", "--device", "cpu"]


@pytest.fixture
def given_here(monkeypatch):
    """`here` as a profile with given figures: nothing is measured."""
    from tandem.simulate import host
    from tests.support.host_profiles import given_host

    measured = given_host(2, small_rate=50e9, switch_s=1e-3)
    monkeypatch.setattr(host, "host_profile", lambda ranks: measured)
    return measured


@pytest.mark.parametrize("opt_out, has_prior", [([], True), (["--overlap-prior", "none"], False)])
def test_serve_hands_its_ranks_the_simulated_prior_unless_opted_out(monkeypatch, given_here, opt_out, has_prior):
    from typer.testing import CliRunner

    import tandem.serving.server as server
    from tandem.cli import app

    seen = {}
    monkeypatch.setattr(server, "run_server", lambda config, options, http: seen.setdefault("config", config))
    result = CliRunner().invoke(app, ["serve", *AUTO_DP2, *opt_out, "--port", "0"])
    assert result.exit_code == 0, result.output
    prior = seen["config"].overlap.simulated_prior
    assert (prior is not None) == has_prior
    assert ("[tandem] auto starts from tandem simulate --hardware here: DBO / none predicted decode 8: " in result.output) == has_prior
    if has_prior:
        assert prior["config"]["simulated"]["hardware"] == given_here.name and prior["sweep"]["prefill"]


def test_generate_hands_its_ranks_the_simulated_prior(monkeypatch, given_here):
    from typer.testing import CliRunner

    import tandem.cli as cli

    seen = {}

    def ranks(config, prompts, params, torchrun, log):
        seen["config"] = config
        return [[]]

    monkeypatch.setattr(cli, "_generate_on_ranks", ranks)
    result = CliRunner().invoke(cli.app, ["generate", "hi", *AUTO_DP2])
    assert result.exit_code == 0, result.output
    assert seen["config"].overlap.simulated_prior["config"]["simulated"]["ranks"] == 2
    assert "auto starts from tandem simulate --hardware here" in result.output
