"""The simulator as the overlap planner's prior (#31): this host as a profile (`here`), the
terms that make DBO lose on it (transfers on the cores that compute, the split's smaller
GEMMs, hand-overs), the prior in `tandem tune`'s format, and `tandem bench`'s auto mode
starting from it. No processes; the host's rates are given, not measured, unless a test says so."""

from __future__ import annotations

import math

import pytest

from tandem.simulate import simulate
from tandem.simulate.host import gemm_m_half
from tandem.simulate.hardware import HERE
from tandem.simulate.prior import simulated_tune
from tandem.simulate.schedule import YIELD, Step, issue_order, play
from tandem.ubatch.planner import OverlapPlanner, StepShape, TunePrior, overlap_choices
from tests.support.host_profiles import given_host



def _stack(hw, tokens=128):
    return simulate("moe-stack", hw, ep=2, phase="decode", tokens_per_rank=tokens, context=1,
                    modes=["none", "dbo"], low_latency=False).results


def test_the_gemm_curve_goes_through_both_measured_rates():
    # A 32-row GEMM at half the 1024-wide rate: 32 / (32 + h) = 0.5 * 1024 / (1024 + h).
    half = gemm_m_half(1024, 32, 0.5)
    assert half == pytest.approx(34.1333, rel=1e-4)
    assert (32 / (32 + half)) / (1024 / (1024 + half)) == pytest.approx(0.5)
    assert gemm_m_half(1024, 32, 1.0) == 0.0 and gemm_m_half(1024, 32, 1.2) == 0.0
    hw = given_host(2, small_rate=50e9, switch_s=0.0)
    assert hw.gemm_efficiency(1024) == pytest.approx(1.0) and hw.gemm_efficiency(32) == pytest.approx(0.5)
    assert all(len(source) > 20 for source in hw.sources.values())


def test_a_hand_over_costs_the_compute_stream_its_switch():
    one = [Step(0, "attn_core"), YIELD, Step(0, "experts")]
    order = issue_order([one, one], [0, 0])  # a0, b0, a1, b1: three hand-overs
    assert [u for u, _ in order] == [0, 1, 0, 1]
    cost = lambda u, step: 1.0  # noqa: E731
    assert max(s.end for s in play(order, cost, sync_comm=False)) == 4.0
    assert max(s.end for s in play(order, cost, sync_comm=False, switch_s=0.25)) == 4.75


def test_on_a_host_whose_cores_do_the_transfers_dbo_hides_nothing():
    # Equal GEMM rates at every size and free hand-overs: the split step is the unsplit one but
    # for the float32 weights (4 bytes each) the second ubatch reads again where a GEMM is
    # bound by its bytes (6.6 us).
    none, dbo = _stack(given_host(2, small_rate=100e9, switch_s=0.0))
    # The final norm adds the last layer's residual (G9): 4 passes of 128 x 1024 x 2 bytes at
    # 20 GB/s in the head, 26.2 us of the 71.1077 ms.
    assert none.step_s == pytest.approx(71.1077e-3, rel=1e-5)
    assert dbo.step_s - none.step_s == pytest.approx(6.5536e-6, rel=1e-3)
    # Transfers in float32 (4 bytes an element, as the ranks send them): 128 tokens x 1.5 ranks
    # x 4 KiB, 8 transfers, at the 20 GB/s copy rate.
    assert none.comm_s == pytest.approx(dbo.comm_s) == pytest.approx(8 * 128 * 1.5 * 4096 / 20e9)
    # 1 ms per hand-over: the stack's DBO issue order (4 layers, 2 ubatches) has 17 of them.
    none, dbo = _stack(given_host(2, small_rate=100e9, switch_s=1e-3))
    assert dbo.step_s - none.step_s == pytest.approx(17e-3 + 6.5536e-6)
    # Half-rate short GEMMs: the halves' smaller GEMMs cost 26.3 ms more than the whole batch's.
    none, dbo = _stack(given_host(2, small_rate=50e9, switch_s=0.0))
    assert (none.step_s, dbo.step_s) == (pytest.approx(95.180e-3, rel=1e-4), pytest.approx(121.517e-3, rel=1e-4))


def test_a_simulated_sweep_is_a_tune_file_the_planner_reads(tmp_path):
    import json

    from tandem.simulate import load_hardware

    _, doc = simulated_tune(
        "deepseek-v3", load_hardware("h800"), ranks=32, num_ubatches=2,
        grids={"decode": [8, 64, 128, 256], "prefill": [128, 256, 2048]}, contexts={"decode": 128, "prefill": 512},
        margin=0.03,
    )
    # Decode at small batches is weight-bound: each ubatch reads every weight again.
    assert (doc["dbo_decode_token_threshold"], doc["dbo_prefill_token_threshold"]) == (128, 256)
    decode = {r["tokens_per_rank"]: r for r in doc["sweep"]["decode"]}
    assert (decode[8]["none_ms"], decode[8]["dbo_ms"]) == (pytest.approx(18.6417, abs=1e-3), pytest.approx(34.5395, abs=1e-3))
    assert decode[128]["paired_speedup"] == pytest.approx(1.1164, abs=1e-4) and decode[128]["dbo_wins"]
    path = tmp_path / "h800.json"
    path.write_text(json.dumps(doc))
    prior = TunePrior.from_file(path)
    none, dbo = overlap_choices(2, dbo=True, sbo=False)
    assert prior.predict(none, StepShape(8)) == pytest.approx(18.6417e-3, abs=1e-6)
    assert prior.predict(dbo, StepShape(2048, decode=False)) < prior.predict(none, StepShape(2048, decode=False))
    planner = OverlapPlanner([none, dbo], explore_share=0.0, prior=prior)
    assert planner.choose(planner.predict(StepShape(8)), [True, True], none).choice is none
    assert planner.choose(planner.predict(StepShape(256)), [True, True], none).choice is dbo


def test_a_sweep_needs_both_phases_and_a_split():
    hw = given_host(2, small_rate=100e9, switch_s=0.0)
    with pytest.raises(ValueError, match="each phase"):
        simulated_tune("moe-stack", hw, ranks=2, num_ubatches=2, grids={"decode": [8]}, contexts={}, margin=0.03)
    with pytest.raises(ValueError, match="at least 2 ubatches"):
        simulated_tune("moe-stack", hw, ranks=2, num_ubatches=1, grids={}, contexts={}, margin=0.03)


def _flags(**over):
    base = dict(thresholds_file=None, fabric=None, fabric_latency_us=None, fabric_gbps=None, device="cpu",
                data_parallel_size=2, model="moe-stack", num_ubatches=2)
    return {**base, **over}


def test_bench_auto_starts_from_this_hosts_prediction(monkeypatch):
    from tandem import cli_bench
    from tandem.simulate import host

    measured = given_host(2, small_rate=50e9, switch_s=1e-3)
    monkeypatch.setattr(host, "host_profile", lambda ranks: measured)
    with cli_bench.auto_prior(_flags(), ["none", "auto"], "decode", [32, 512], context_len=128, prefill_len=512) as (path, doc):
        prior = TunePrior.from_file(path)
    assert doc["config"]["simulated"] == {"model": "moe-stack", "hardware": measured.name, "ranks": 2,
                                          "contexts": {"decode": 128, "prefill": 512}}
    none, dbo = overlap_choices(2, dbo=True, sbo=False)
    for tokens in (32, 512):
        assert prior.predict(dbo, StepShape(tokens)) > prior.predict(none, StepShape(tokens))
    assert doc["dbo_decode_token_threshold"] == 2**31 - 1  # DBO never wins here
    assert not math.isinf(prior.predict(none, StepShape(32)))


@pytest.mark.parametrize("over, modes", [
    (dict(thresholds_file="tuned.json"), ["auto"]),
    (dict(fabric="calibrated"), ["auto"]),
    (dict(fabric_gbps=1.0), ["auto"]),
    (dict(data_parallel_size=1), ["auto"]),
    ({}, ["none", "dbo"]),
])
def test_bench_keeps_a_given_file_and_predicts_nothing_it_cannot(over, modes):
    from tandem import cli_bench

    with cli_bench.auto_prior(_flags(**over), modes, "decode", [32], context_len=128, prefill_len=512) as (path, doc):
        assert (path, doc) == (over.get("thresholds_file"), None)


@pytest.mark.slow  # two gloo ranks measure the transfers
def test_here_is_measured_when_asked_for():
    from tandem.simulate.host import resolve_hardware

    hw = resolve_hardware(HERE, 2)
    assert hw.transfers_on_compute and hw.gpus_per_node == 2
    assert hw.bf16_flops > 1e9 and hw.ubatch_switch_s > 0 and hw.gemm_m_half >= 0
    assert hw.cold_weight_bytes_per_s > 0 and all(hw.nvlink_bytes_per_s[k] > 0 for k in ("dispatch", "combine"))
    assert all(hw.comm_latency_s[k] >= 0 for k in ("dispatch", "combine"))


def test_tune_simulate_writes_the_thresholds_file_serve_reads(tmp_path):
    from typer.testing import CliRunner

    from tandem.cli import app
    from tandem.config import OverlapConfig

    out = tmp_path / "h800.json"
    result = CliRunner().invoke(app, [
        "tune", "--simulate", "h800", "--model", "deepseek-v3", "--data-parallel-size", "32", "--context-len", "128",
        "--decode-tokens", "8,64,128,256", "--prefill-tokens", "128,256,2048", "--output", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert "decode 128, prefill 256" in result.output and "speedup: simulated" in result.output
    doc = __import__("json").loads(out.read_text())
    assert doc["config"] == {"num_ubatches": 2, "simulated": {
        "model": "deepseek-v3", "hardware": "H800", "ranks": 32, "contexts": {"decode": 128, "prefill": 512}}}
    assert [r["tokens_per_rank"] for r in doc["sweep"]["prefill"]] == [128, 256, 2048]
    # 50.1646 while every op of DBO paid for the overlap all step; 46.9267 once only while it
    # overlaps; 47.0036 with the residual add in the next input norm (G9); the normal kernels' shares
    # taken against the table's own call time (not the blog's unit-test bars) make it 46.8266; the
    # runtime's normal-kernel DBO order (send after the yield, compute joined to it, the dispatch's
    # CPU wait) 46.8186.
    assert doc["sweep"]["prefill"][1]["dbo_ms"] == pytest.approx(46.8186, abs=1e-3)
    overlap = OverlapConfig().with_thresholds_file(out)
    assert (overlap.dbo_decode_token_threshold, overlap.dbo_prefill_token_threshold) == (128, 256)
    assert TunePrior.from_file(out).num_ubatches == 2


@pytest.mark.parametrize("args, message", [
    (["--simulate", "h900"], "unknown hardware 'h900'"),
    (["--simulate", "h800", "--num-ubatches", "1"], "at least 2 ubatches"),
    (["--simulate", "h800", "--model", "no-such-model"], "is not a preset"),
])
def test_tune_simulate_names_what_is_wrong(tmp_path, args, message):
    from typer.testing import CliRunner

    from tandem.cli import app

    result = CliRunner().invoke(app, ["tune", *args, "--output", str(tmp_path / "x.json")])
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "x.json").exists()


def test_a_cpu_host_reads_its_float32_weights_at_four_bytes_each():
    """The fp8 / bf16 widths belong to GPU profiles: a host's ranks compute in float32, so a
    one-row GEMM (bound by its weight's bytes) costs 4 bytes an element at the read rate."""
    hw = given_host(2, small_rate=100e9, switch_s=0.0)
    n = k = 4096
    bytes_ = (n * k + k + n) * 4
    assert hw.gemm_time(1, n, k, fp8=True) == hw.gemm_time(1, n, k, fp8=False) == pytest.approx(bytes_ / hw.hbm_rate())
