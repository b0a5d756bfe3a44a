"""`--hardware here` over a shaped link (#31): a transfer's CPU part stays on the compute stream,
its wire part runs on the comm stream, so `none` pays both in sequence and an overlapped mode
hides only the wire. Hand-computed steps on a host whose every op is free but the transfers."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from tandem.cli import app
from tandem.simulate import HardwareProfile, load_hardware, simulate
from tandem.simulate.schedule import Step, play
from tandem.simulate.shaped_link import (
    FAIR_SHARE,
    FRAME_PAYLOAD_BYTES,
    FRAME_WIRE_BYTES,
    LINK_FIGURE,
    ShapedLink,
    link_seconds_per_byte,
    over_link,
    overlap_rate_over_link,
)

TOKENS = 512
#: Bytes leaving one of 2 ranks per moe-stack transfer (hidden 1024, top-2 of 8 experts, float32):
#: each token goes to 2 * (1 - 1/2**2) = 1.5 ranks on average, half of them the other one.
WIRE_BYTES = TOKENS * 1.5 * 1024 * 4 / 2
#: moe-stack: 4 MoE layers, a dispatch and a combine each.
SENDS = 8
CPU_S = 1e-3


def free_host(**extra) -> HardwareProfile:
    """A host whose cores move the transfers, every op free but a transfer's CPU part: 1 ms a
    call, nothing per byte (the fixed part, paid once per ubatch)."""
    figures = dict(
        sms=1, comm_sms_normal=0, comm_sms_low_latency=0, transfers_on_compute=True, gpus_per_node=2,
        nvlink_bytes_per_s={"dispatch": math.inf, "combine": math.inf}, comm_latency_s={"dispatch": CPU_S, "combine": CPU_S},
        hbm_bytes_per_s=math.inf, hbm_efficiency=1.0, bf16_flops=math.inf, fp8_flops=math.inf, element_bytes=4,
        gemm_efficiency_max=1.0, gemm_m_half=0.0, attention_prefill_efficiency=1.0, attention_decode_flops=math.inf,
        attention_decode_bytes_per_s=math.inf, ubatch_switch_s=0.0, **extra,
    )  # fmt: skip
    return HardwareProfile("free host", figures, {k: "test" for k in figures})


def steps_ms(hw: HardwareProfile, modes=("none", "dbo", "tbo")) -> dict[str, float]:
    sim = simulate("moe-stack", hw, ep=2, phase="prefill", tokens_per_rank=TOKENS, context=1, modes=list(modes))
    return {r.mode: round(r.step_s * 1e3, 9) for r in sim.results}


def with_wire(full_batch_wire_s: float) -> HardwareProfile:
    """The free host over a link on which one full-batch transfer takes `full_batch_wire_s`."""
    link = ShapedLink(100.0, full_batch_wire_s / WIRE_BYTES, "test")
    return over_link(free_host(), link)


def test_none_pays_the_cpu_part_then_the_wire_of_every_transfer():
    # 8 transfers x (1 ms CPU + 3 ms wire), nothing overlapped.
    assert steps_ms(with_wire(3e-3))["none"] == pytest.approx(32.0)
    # Without the link the same host pays the CPU parts only.
    assert steps_ms(free_host(), modes=("none",))["none"] == pytest.approx(8.0)


def test_dbo_hides_the_wire_but_not_the_cpu_part_when_the_wire_bounds_the_step():
    # 2 ubatches: 16 CPU parts of 1 ms (the fixed part per call, per ubatch) and 16 wires of
    # 1.5 ms. After the first CPU part the comm stream runs back to back: 1 + 16 x 1.5 ms.
    steps = steps_ms(with_wire(3e-3))
    assert steps["dbo"] == pytest.approx(25.0)
    assert steps["tbo"] == pytest.approx(25.0)


def test_dbo_pays_every_cpu_part_when_the_cores_bound_the_step():
    # 16 CPU parts back to back on the compute stream, then the last wire (0.25 ms): the split
    # costs more than none's 8 x (1 + 0.5) ms, the sign a host whose transfers are CPU gives.
    steps = steps_ms(with_wire(0.5e-3))
    assert steps["none"] == pytest.approx(12.0)
    assert steps["dbo"] == pytest.approx(16.25)


def test_the_nominal_link_charges_whole_frames_at_the_set_rate():
    link = ShapedLink.nominal(100.0)
    assert link.seconds_per_byte == pytest.approx(8 * FRAME_WIRE_BYTES / FRAME_PAYLOAD_BYTES / 100e6)
    assert "1514" in link.source


def test_a_calibrated_link_scales_the_probe_by_the_measured_exponent():
    link = ShapedLink.calibrated(100.0, probes=[(400.0, 2e-8)], exponent=1.5, how="two probes")
    assert link.seconds_per_byte == pytest.approx(2e-8 * 4**1.5)
    assert link.source.startswith("measured in this run: two probes")


def test_a_calibrated_link_is_its_probe_at_a_probed_rate_and_log_log_between_probes():
    probes = [(400.0, 2e-8), (100.0, 1.2e-7), (200.0, 5e-8)]  # any order
    at = lambda rate: ShapedLink.calibrated(rate, probes=probes, exponent=1.0, how="probes").seconds_per_byte  # noqa: E731
    assert at(200.0) == pytest.approx(5e-8)
    # Halfway in log rate between 100 and 200 Mbit/s: the geometric mean of their times.
    assert at(100.0 * 2**0.5) == pytest.approx((1.2e-7 * 5e-8) ** 0.5)
    # Beyond the probes, the nearest one at the given exponent, not the end pair's slope.
    assert at(50.0) == pytest.approx(1.2e-7 * 2.0)
    assert at(800.0) == pytest.approx(2e-8 / 2.0)
    assert "between the 100 and 200 Mbit/s probes" in ShapedLink.calibrated(150.0, probes=probes, exponent=1.0, how="p").source
    # Two probes at one rate are one point, their mean.
    twice = ShapedLink.calibrated(200.0, probes=probes + [(200.0, 7e-8)], exponent=1.0, how="p")
    assert twice.seconds_per_byte == pytest.approx(6e-8)


def test_the_link_is_a_figure_of_the_profile_with_its_source():
    hw = over_link(free_host(), ShapedLink.nominal(250.0))
    assert link_seconds_per_byte(hw) == pytest.approx(ShapedLink.nominal(250.0).seconds_per_byte)
    assert "tbf" in hw.sources[LINK_FIGURE]
    assert hw.name == "free host over a 250 Mbit/s link"
    assert link_seconds_per_byte(free_host()) is None


@pytest.mark.parametrize("rate", [0.0, -5.0, math.nan, math.inf])
def test_a_bad_rate_is_refused(rate):
    with pytest.raises(ValueError, match="positive number of Mbit/s"):
        ShapedLink.nominal(rate)


@pytest.mark.parametrize("probes, exponent", [([(400.0, 0.0)], 1.0), ([(400.0, 2e-8)], -1.0), ([(0.0, 2e-8)], 1.0), ([], 1.0)])
def test_a_bad_calibration_is_refused(probes, exponent):
    with pytest.raises(ValueError):
        ShapedLink.calibrated(100.0, probes=probes, exponent=exponent, how="test")


def test_a_gpu_profile_gets_no_shaped_link():
    with pytest.raises(ValueError, match="cores move the transfers"):
        over_link(load_hardware("h800"), ShapedLink.nominal(100.0))


def test_the_cli_refuses_a_bad_link_rate_before_measuring_anything():
    result = CliRunner().invoke(app, ["simulate", "--hardware", "here", "--ep", "2", "--link-mbit", "-3"], terminal_width=200)
    assert result.exit_code == 2
    assert "positive number of Mbit/s" in result.output


def test_the_cli_refuses_a_link_on_a_gpu_profile():
    result = CliRunner().invoke(app, ["simulate", "--hardware", "h800", "--link-mbit", "100"], terminal_width=200)
    assert result.exit_code == 2
    assert "cores move the transfers" in result.output


def test_the_cli_plays_here_over_the_link(monkeypatch):
    from tandem.simulate import host

    monkeypatch.setattr(host, "host_profile", lambda ranks: free_host())
    args = ["simulate", "--hardware", "here", "--model", "moe-stack", "--ep", "2", "--phase", "prefill",
            "--tokens-per-rank", str(TOKENS), "--context", "1", "--modes", "none,dbo"]
    nominal_wire_ms = SENDS * WIRE_BYTES * ShapedLink.nominal(100.0).seconds_per_byte * 1e3
    result = CliRunner().invoke(app, [*args, "--link-mbit", "100"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "over a 100 Mbit/s link" in result.output
    rows = {line.split()[0]: line.split() for line in result.output.splitlines()[2:] if line.split()}
    # none: 8 CPU parts of 1 ms, then each transfer's bytes at the nominal rate.
    assert float(rows["none"][1]) == pytest.approx(SENDS * CPU_S * 1e3 + nominal_wire_ms, abs=0.01)


def test_packets_on_the_wire_take_their_share_of_the_core_down_to_a_fair_half():
    link = ShapedLink(100.0, 10e-9, "test")
    assert link.with_cpu_per_byte(2e-9, "test").compute_rate == pytest.approx(0.8)
    assert link.with_cpu_per_byte(8e-9, "test").compute_rate == FAIR_SHARE  # the scheduler's fair half
    assert link.with_cpu_per_byte(0.0, "test").compute_rate == 1.0
    with pytest.raises(ValueError):
        link.with_cpu_per_byte(-1e-9, "test")


def test_compute_under_a_transfer_runs_at_the_links_compute_rate():
    # ubatch 0 sends (4 ms on the wire), ubatch 1 computes 3 ms meanwhile: at half its core for
    # the 4 ms the wire runs it does 2 ms of work, then the last 1 ms alone: it ends at 5 ms.
    hw = over_link(free_host(), ShapedLink(100.0, 1e-9, "test").with_cpu_per_byte(0.5e-9, "test"))
    order = [(0, Step(0, "dispatch_send")), (1, Step(0, "attn_core")), (0, Step(0, "dispatch_recv"))]
    costs = {"dispatch_send": 4.0, "attn_core": 3.0}

    def cost(u, step):
        return costs[step.name]

    slowed = play(order, cost, sync_comm=False, overlap_rate=overlap_rate_over_link(hw))
    assert max(s.end for s in slowed) == pytest.approx(5.0)
    assert max(s.end for s in play(order, cost, sync_comm=False, overlap_rate=overlap_rate_over_link(free_host()))) == 4.0


def test_a_transfer_beside_compute_keeps_the_links_wire_rate():
    # ubatch 0 sends (4 ms alone), ubatch 1 computes 3 ms meanwhile: at half its pace for those
    # 3 ms the wire moves 1.5 ms of its bytes, the last 2.5 ms alone: it lands at 5.5 ms, and
    # compute, which keeps its whole core here, ends at 3.
    order = [(0, Step(0, "dispatch_send")), (1, Step(0, "attn_core")), (0, Step(0, "dispatch_recv"))]
    costs = {"dispatch_send": 4.0, "attn_core": 3.0}
    link = ShapedLink(100.0, 1e-9, "test").with_wire_rate(0.5, "test")
    assert link.wire_rate == 0.5 and link.wire_rate_source == "measured in this run: test"
    spans = play(order, lambda u, s: costs[s.name], sync_comm=False, overlap_rate=overlap_rate_over_link(over_link(free_host(), link)))
    assert {s.step.name: s.end for s in spans} == pytest.approx({"dispatch_send": 5.5, "attn_core": 3.0})
    with pytest.raises(ValueError, match="wire rate under compute"):
        link.with_wire_rate(0.0, "test")
