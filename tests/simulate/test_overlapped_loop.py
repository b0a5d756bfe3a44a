"""The scheduler loop in `tandem simulate` (#31): with the engine's host work a step given
(`--host-step-ms`), each mode's step under the normal loop (device + host) and the overlapped
one (max(device, host) where the device is apart from the host, device + host on a host whose
cores compute); without it, the table as before and one line saying the loop was not simulated."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tandem.cli import app
from tandem.simulate import format_table, host, load_hardware, simulate
from tandem.simulate.host_loop import scheduler_loops
from tests.support.host_profiles import given_host

H800 = ["--model", "deepseek-v3", "--hardware", "h800", "--ep", "32", "--phase", "prefill", "--tokens-per-rank", "4096",
        "--modes", "none,dbo,tbo"]
#: `tandem simulate` with H800 above, as it printed before the loop existed (byte for byte).
H800_TABLE = """\
deepseek-v3 on H800, DP-attention x EP32 (normal DeepEP kernels), prefill: 4096 tokens/rank, context 4096
mode                     step ms   tok/s/GPU  vs none  compute ms   comm ms  floor ms vs floor
none                      792.20        5170    1.00x      408.81    383.39    408.81    1.94x
dbo                       537.40        7622    1.47x      482.18    439.15    482.18    1.11x
tbo                       529.05        7742    1.50x      482.82    440.45    482.82    1.10x
"""


def _here():
    return given_host(2, small_rate=100e9, switch_s=1e-3)


def test_on_a_gpu_the_normal_loop_adds_the_host_work_and_the_overlapped_one_hides_it():
    h800 = load_hardware("h800")
    # 10 ms on the device, 2 ms on the host, 1000 tokens: 12 ms against 10 ms.
    loops = scheduler_loops(10e-3, 1000.0, 2e-3, h800)
    assert loops.normal_s == pytest.approx(12e-3) and loops.overlapped_s == pytest.approx(10e-3)
    assert loops.normal_tokens_per_s == pytest.approx(1000 / 12e-3)  # 83,333
    assert loops.overlapped_tokens_per_s == pytest.approx(1000 / 10e-3)  # 100,000
    assert loops.speedup == pytest.approx(1.2)
    # Host work longer than the device's: the loop waits for the host; 25 ms against 15 ms.
    slow_host = scheduler_loops(10e-3, 1000.0, 15e-3, h800)
    assert slow_host.normal_s == pytest.approx(25e-3) and slow_host.overlapped_s == pytest.approx(15e-3)
    assert slow_host.speedup == pytest.approx(25 / 15)


def test_on_a_host_whose_cores_compute_the_overlapped_loop_gains_nothing():
    here = _here()
    assert here.transfers_on_compute
    loops = scheduler_loops(10e-3, 1000.0, 2e-3, here)
    assert loops.normal_s == pytest.approx(12e-3) and loops.overlapped_s == pytest.approx(12e-3)
    assert loops.speedup == 1.0


def test_every_mode_reports_both_loops_through_the_api():
    sim = simulate("deepseek-v3", "h800", ep=128, phase="decode", tokens_per_rank=128, context=4096,
                   modes=["none", "dbo", "tbo"], draft_tokens=1, acceptance=0.6, host_step_ms=2.0)
    assert sim.host_step_s == pytest.approx(2e-3)
    for r in sim.results:
        assert r.loops.device_s == r.step_s and r.loops.tokens == r.tokens
        assert r.loops.normal_s == pytest.approx(r.step_s + 2e-3)
        assert r.loops.overlapped_s == r.step_s  # the device's step is well over 2 ms
        assert r.loops.overlapped_tokens_per_s == pytest.approx(r.tokens_per_s)
    here = simulate("moe-stack", _here(), ep=2, phase="decode", tokens_per_rank=128, context=1, modes=["none", "dbo"],
                    host_step_ms=2.0)
    for r in here.results:
        assert r.loops.overlapped_s == r.loops.normal_s == pytest.approx(r.step_s + 2e-3)


def test_without_a_host_figure_the_loop_is_not_simulated_and_the_table_is_unchanged():
    sim = simulate("deepseek-v3", "h800", ep=32, phase="prefill", tokens_per_rank=4096, modes=["none", "dbo", "tbo"])
    assert sim.host_step_s is None and all(r.loops is None for r in sim.results)
    assert format_table(sim) + "\n" == H800_TABLE
    result = CliRunner().invoke(app, ["simulate", *H800], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert result.stdout == H800_TABLE
    assert result.stderr.strip() == (
        "scheduler loop: not simulated (give --host-step-ms, the engine's CPU work a step outside the forward)")


def test_the_cli_prints_both_loops_below_the_same_table():
    result = CliRunner().invoke(app, ["simulate", *H800, "--host-step-ms", "2"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(H800_TABLE + "\n")
    loops = result.stdout[len(H800_TABLE) + 1:].splitlines()
    assert loops[0] == "scheduler loop, 2.00 ms host work a step (given; overlapped beside the device)"
    rows = {line.split()[0]: line.split()[1:] for line in loops[2:]}
    # none: 792.20 ms on the device; the normal loop 794.20 ms, the overlapped 792.20 ms.
    assert rows["none"][0] == "794.20" and rows["none"][2] == "792.20" and rows["none"][4] == "1.00x"
    assert "not simulated" not in result.output


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_the_cli_refuses_a_negative_or_non_finite_host_figure_before_measuring(value, monkeypatch):
    monkeypatch.setattr(host, "host_profile", lambda ranks: pytest.fail("measured before refusing"))
    result = CliRunner().invoke(app, ["simulate", "--hardware", "here", "--ep", "2", "--host-step-ms", value],
                                terminal_width=200)
    assert result.exit_code == 2, result.output
    assert "--host-step-ms must be a finite number of milliseconds >= 0" in result.output
