"""`--overlap-policy auto` on real links starts from the simulator's prior (#31): the tune
document of one step (`simulated_step_tune`), the one benchmarks/real_links.py builds per row on
the profile and link the row's predictions use (`real_links_predict.auto_prior`), and the same
document on every rank (`agreed_document`). No namespaces; nothing timed."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from tandem import tune_sweep
from tandem.config import OverlapConfig
from tandem.simulate import simulate
from tandem.simulate.prior import agreed_document, simulated_step_tune
from tandem.testing import run_distributed
from tandem.ubatch.planner import OverlapPlanner, StepShape, overlap_choices
from tandem.worker.planner_cache import starting_prior
from tests.support.host_profiles import given_host

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SAVED_RUN = BENCHMARKS / "results" / "real_links.json"


def _real_links_predict():
    """benchmarks/real_links_predict.py as a module (benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("real_links_predict", BENCHMARKS / "real_links_predict.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_a_step_document_holds_the_simulated_none_and_dbo_under_the_phase_it_is_costed_as():
    hw = given_host(2, small_rate=100e9, switch_s=1e-3)
    document = simulated_step_tune("moe-stack", hw, ranks=2, num_ubatches=2, phase="prefill", tokens_per_rank=128,
                                   context=1, margin=tune_sweep.MARGIN, costed_as="decode")
    none, dbo = simulate("moe-stack", hw, ep=2, phase="prefill", tokens_per_rank=128, context=1,
                         modes=["none", "dbo2"]).results
    (row,) = document["sweep"]["decode"]
    assert (row["tokens_per_rank"], row["none_ms"], row["dbo_ms"]) == (128, round(none.step_s * 1e3, 4), round(dbo.step_s * 1e3, 4))
    assert document["sweep"]["prefill"] == []
    assert document["config"]["num_ubatches"] == 2 and document["config"]["simulated"]["phase"] == "prefill"
    # The hand-overs make DBO lose on this host: DBO off by both thresholds.
    assert dbo.step_s > none.step_s and document["dbo_decode_token_threshold"] == document["dbo_prefill_token_threshold"] == 2**31 - 1
    # The planner reads it through the one parser, and predicts the step the prior says.
    prior = starting_prior(OverlapConfig(simulated_prior=document))
    planner = OverlapPlanner(overlap_choices(2, dbo=True, sbo=False), prior=prior)
    assert planner.predict(StepShape(128)) == pytest.approx([none.step_s, dbo.step_s], rel=1e-6)
    assert all(math.isinf(p) for p in planner.predict(StepShape(128, decode=False)))


def test_a_step_is_costed_as_decode_or_prefill():
    with pytest.raises(ValueError, match="costed as one of decode, prefill"):
        simulated_step_tune("moe-stack", given_host(2, small_rate=100e9, switch_s=0.0), ranks=2, num_ubatches=2,
                            phase="decode", tokens_per_rank=8, context=1, margin=tune_sweep.MARGIN, costed_as="verify")


@pytest.mark.skipif(not SAVED_RUN.exists(), reason="no saved real_links run")
def test_auto_starts_at_each_row_from_the_steps_that_row_predicts_for_none_and_dbo():
    """On the saved run's own host profile and probes, a row's prior is the row prediction's
    none and dbo (the same profile, link and thread hand-over), filed where the planner looks:
    the MoE stack under decode whatever its phase, a model step under its own phase."""
    rlp = _real_links_predict()
    saved = json.loads(SAVED_RUN.read_text())
    host = saved["host_profile"]
    for job in (j for j in saved["jobs"] if j["workload"] == "moe-stack" and j["phase"] == "prefill"):
        row = job["rows"][0]
        document = rlp.auto_prior(job, saved["plan"], host, row["rate_mbit"])
        (predicted,) = [r for r in rlp.predict_job(job, saved["plan"], host)["rows"] if r["rate_mbit"] == row["rate_mbit"]]
        (entry,) = document["sweep"]["decode"]
        assert document["sweep"]["prefill"] == [] and entry["tokens_per_rank"] == job["tokens"]
        assert entry["none_ms"] == pytest.approx(predicted["modes"]["none"]["predicted_s"] * 1e3, abs=1e-3)
        assert entry["dbo_ms"] == pytest.approx(predicted["modes"]["dbo"]["predicted_s"] * 1e3, abs=1e-3)
        assert f"{row['rate_mbit']:g} Mbit/s link" in document["config"]["simulated"]["hardware"]
        return
    pytest.skip("the saved run has no moe-stack prefill job")


@pytest.mark.skipif(not SAVED_RUN.exists(), reason="no saved real_links run")
def test_a_rows_link_loses_at_the_measured_rate_what_the_measurement_lost():
    """The run's compute-under-transfer (a loop kept 0.7 of its core at 300 Mbit/s; the wire
    kept 0.8 of its pace beside it) on a saved job: the job's link at 300 Mbit/s gives compute
    0.7, a slower link less loss (the packets' CPU is per byte), and the wire its 0.8."""
    rlp = _real_links_predict()
    saved = json.loads(SAVED_RUN.read_text())
    job = next(j for j in saved["jobs"] if j["workload"] == "moe-stack" and j["phase"] == "prefill")
    under = {"rate_mbit": 300.0, "rate": 0.7, "wire_rate": 0.8, "beside_loop_s": [0.3], "wire_s": [0.25],
             "under_transfer_s": [0.1], "alone_s": [0.07]}
    c = rlp.CalibratedJob.of({**job, "compute_under_transfer": under}, saved["plan"], saved["host_profile"])
    at, slower = c.link(300.0), c.link(150.0)
    assert at.compute_rate == pytest.approx(0.7, rel=1e-9) and at.wire_rate == 0.8
    assert 0.7 < slower.compute_rate < 1.0 and slower.wire_rate == 0.8


@pytest.mark.skipif(not SAVED_RUN.exists(), reason="no saved real_links run")
def test_a_rows_link_is_the_probe_taken_at_its_own_rate():
    """A job that probed its link at a row's rate (the none step's comm there, before the row)
    prices that row's wire from that probe, not from the two probes' exponent."""
    rlp = _real_links_predict()
    saved = json.loads(SAVED_RUN.read_text())
    job = {k: v for k, v in next(j for j in saved["jobs"] if j["workload"] == "small-moe" and j["phase"] == "decode").items()
           if k != "rate_probes"}
    extrapolated = rlp.CalibratedJob.of(job, saved["plan"], saved["host_profile"])
    probe_s = 2.0 * extrapolated.link(60.0).seconds_per_byte * extrapolated.wire_bytes  # twice what the exponent says
    c = rlp.CalibratedJob.of({**job, "rate_probes": [[60.0, probe_s]]}, saved["plan"], saved["host_profile"])
    assert c.link(60.0).seconds_per_byte == pytest.approx(probe_s / c.wire_bytes, rel=1e-9)


@pytest.mark.skipif(not SAVED_RUN.exists(), reason="no saved real_links run")
def test_a_slowdown_the_repeats_do_not_resolve_is_priced_as_none():
    """The wire beside compute counts only where every slow sample is above every fast one, and
    compute under a transfer only where its mean is above every loop alone: else compute keeps
    its whole core and the wire its whole pace."""
    rlp = _real_links_predict()
    saved = json.loads(SAVED_RUN.read_text())
    job = next(j for j in saved["jobs"] if j["workload"] == "moe-stack" and j["phase"] == "prefill")
    under = {"rate_mbit": 300.0, "rate": 0.7, "wire_rate": 0.3, "beside_loop_s": [0.14, 0.26], "wire_s": [0.13, 0.25],
             "under_transfer_s": [0.06, 0.061, 0.066], "alone_s": [0.061, 0.063]}
    link = rlp.CalibratedJob.of({**job, "compute_under_transfer": under}, saved["plan"], saved["host_profile"]).link(300.0)
    assert link.compute_rate == 1.0 and link.wire_rate == 1.0
    assert "not resolved" in link.wire_rate_source and "not resolved" in link.compute_rate_source


@pytest.mark.skipif(not SAVED_RUN.exists(), reason="no saved real_links run")
@pytest.mark.parametrize("workload, phase", [("moe-stack", "decode"), ("small-moe", "decode")])
def test_a_job_prices_its_unshaped_none_step_as_it_measured_it_keeping_its_own_transfer_line(workload, phase):
    """The profile's CPU costs (the fused experts' rates among them, where the profile has them)
    are scaled to the job's unshaped none step (measured at its start, before any row), the
    job's own transfer line (measured on the ranks) left as measured."""
    rlp = _real_links_predict()
    saved = json.loads(SAVED_RUN.read_text())
    host = saved["host_profile"]
    host = {**host, "figures": {"fused_experts_weight_bytes_per_s": 40e9, "fused_experts_flops": 100e9, **host["figures"]}}
    job = next(j for j in saved["jobs"] if j["workload"] == workload and j["phase"] == phase)
    slower = {**job, "unshaped_none_s": 1.3 * job["unshaped_none_s"]}
    c, s = (rlp.CalibratedJob.of(j, saved["plan"], host) for j in (job, slower))
    assert c.unshaped_none_s == pytest.approx(job["unshaped_none_s"], rel=1e-6)
    assert s.unshaped_none_s == pytest.approx(slower["unshaped_none_s"], rel=1e-6) and s.cpu_scale > c.cpu_scale
    own = {k: v[0] for k, v in rlp._veth_figures(job).items()}
    for hw in (c.base, s.base):
        assert {k: hw.figures[k] for k in own} == own
    assert s.base.figures["bf16_flops"] < c.base.figures["bf16_flops"]
    assert s.base.figures["fused_experts_flops"] < c.base.figures["fused_experts_flops"]


@pytest.mark.skipif(not SAVED_RUN.exists(), reason="no saved real_links run")
def test_a_job_without_its_own_line_keeps_the_hosts_line_unscaled():
    rlp = _real_links_predict()
    saved = json.loads(SAVED_RUN.read_text())
    job = next(j for j in saved["jobs"] if j["workload"] == "moe-stack" and j["phase"] == "decode")
    bare = {k: v for k, v in job.items() if k != "veth_line_points"}
    c = rlp.CalibratedJob.of({**bare, "unshaped_none_s": 1.3 * job["unshaped_none_s"]}, saved["plan"], saved["host_profile"])
    assert c.unshaped_none_s == pytest.approx(1.3 * job["unshaped_none_s"], rel=1e-6)
    for key in ("comm_latency_s", "nvlink_bytes_per_s"):
        assert c.base.figures[key] == saved["host_profile"]["figures"][key]
    with pytest.raises(ValueError, match="no CPU scale"):
        rlp.CalibratedJob.of({**bare, "unshaped_none_s": 1e-6}, saved["plan"], saved["host_profile"])


def test_a_custom_stack_shape_gets_no_prior():
    rlp = _real_links_predict()
    assert rlp.auto_prior({"workload": "moe-stack", "phase": "decode", "tokens": 8, "shape": {"hidden": 64}}, {}, {}, 100.0) is None


def test_without_a_process_group_the_document_is_made_here():
    assert agreed_document(lambda: {"made": "here"}) == {"made": "here"}


def _each_rank_makes_its_own(rank: int, world: int) -> dict:
    return agreed_document(lambda: {"made_on": rank, "sweep": {"decode": [{"tokens_per_rank": 8 * (rank + 1)}]}})


def _rank_zero_fails(rank: int, world: int) -> str:
    def make() -> dict:
        raise ValueError(f"no profile on rank {rank}")

    try:
        agreed_document(make)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_every_rank_gets_rank_zeros_document_and_a_failure_there_fails_every_rank():
    assert run_distributed(_each_rank_makes_its_own, 2, timeout_s=120) == [
        {"made_on": 0, "sweep": {"decode": [{"tokens_per_rank": 8}]}}] * 2
    errors = run_distributed(_rank_zero_fails, 2, timeout_s=120)
    assert errors == ["rank 0 could not make the document every rank starts from: ValueError: no profile on rank 0"] * 2
