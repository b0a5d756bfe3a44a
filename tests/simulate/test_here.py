"""`tandem simulate --hardware here` (#31): the command and the API predict on this host's
profile, measured when asked for (here the measurement is replaced by fixed rates, so the
arithmetic is exact), with gloo's transfers; and the inputs it refuses, each named."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tandem.cli import app
from tandem.simulate import host, simulate
from tests.support.host_profiles import given_host

STACK = ["--model", "moe-stack", "--ep", "2", "--phase", "decode", "--tokens-per-rank", "128", "--context", "1"]


@pytest.fixture
def measured(monkeypatch):
    """Replaces the measurement with fixed rates; records the rank counts it was asked for."""
    asked: list[int] = []

    def fixed(ranks: int):
        asked.append(ranks)
        return given_host(ranks, small_rate=100e9, switch_s=1e-3)

    monkeypatch.setattr(host, "host_profile", fixed)
    return asked


def test_the_cli_predicts_on_the_profile_measured_for_its_ranks(measured):
    result = CliRunner().invoke(app, ["simulate", "--hardware", "here", *STACK, "--modes", "none,dbo"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert measured == [2]  # one measurement, for --ep ranks
    assert "here (CPU, gloo)" in result.output and "gloo transfers on the computing cores" in result.output
    rows = {line.split()[0]: line.split() for line in result.output.splitlines()[2:]}
    # Equal GEMM rates at every size: the unsplit step is 71.11 ms (test_prior pins the same
    # profile through the API); DBO adds its 17 hand-overs at the measured 1 ms each.
    assert float(rows["none"][1]) == pytest.approx(71.11, abs=0.01)
    assert float(rows["dbo"][1]) == pytest.approx(71.11 + 17.0, abs=0.02)


def test_the_api_takes_here_as_a_name_and_plays_gloo_transfers(measured):
    sim = simulate("moe-stack", "here", ep=2, phase="decode", tokens_per_rank=128, context=1, modes=["none", "dbo"])
    assert measured == [2]
    assert not sim.layout.low_latency  # gloo has no low-latency kernels: decode uses the normal path
    none, dbo = sim.results
    assert none.step_s == pytest.approx(71.1077e-3, rel=1e-5)
    assert dbo.step_s - none.step_s == pytest.approx(17e-3 + 6.5536e-6)
    # Transfers on the computing cores: nothing hidden, the step is compute plus comm in both.
    assert none.step_s == pytest.approx(none.compute_s + none.comm_s)


def test_low_latency_kernels_are_refused_on_gloo(measured):
    with pytest.raises(ValueError, match="low-latency kernels are not modelled"):
        simulate("moe-stack", "here", ep=2, phase="decode", tokens_per_rank=8, context=1, low_latency=True)


@pytest.mark.parametrize("args, message", [
    (["--hardware", "here", "--validate"], "--validate compares DeepSeek-V3 with DeepSeek's published"),
    (["--hardware", "here", "--ep", "0"], "needs at least one rank, got 0"),
    (["--hardware", "h900"], "or 'here' (this host, measured now)"),
])
def test_bad_input_is_named_with_exit_2(args, message):
    result = CliRunner().invoke(app, ["simulate", *args], terminal_width=200)
    assert result.exit_code == 2 and message in result.output, result.output


def test_help_says_what_here_measures():
    result = CliRunner().invoke(app, ["simulate", "--help"], terminal_width=200)
    assert result.exit_code == 0
    words = " ".join(result.output.replace("│", " ").split())  # the help's box, wrapped at any width
    assert "'here': this CPU with --ep gloo ranks, measured now" in words
