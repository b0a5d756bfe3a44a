"""The H800 terms (DeepSeek's per-layer profile, DeepGEMM's table) on the other profiles: H100 and
H200 are the same Hopper SM and carry them (H200's memory-bound GEMM rows and elementwise passes
at its own HBM), B200 does not. Each op below is priced by hand from the published figures."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from tandem.simulate.hardware import PROFILES, load_hardware
from tandem.simulate.model_shape import model_shape
from tandem.simulate.ops import Layout, OpCosts, UBatchWork

TERMS = ("gemm_table", "elementwise_passes", "normal_overlap_bandwidth", "normal_barrier_share",
         "rdma_low_latency_sm_s", "ubatch_switch_s")


@pytest.mark.parametrize("name", PROFILES)
def test_each_profile_loads_with_the_h800_terms_where_they_carry(name):
    hw, h800 = load_hardware(name), load_hardware("h800")
    if name == "b200":  # another architecture: not derived, and the notes say so
        assert not set(TERMS) & set(hw.figures) and hw.attention_prefill_efficiency == 0.60
        return
    for term in TERMS + ("attention_prefill_efficiency",):
        assert hw.figures[term] == h800.figures[term], term
        assert name == "h800" or hw.sources[term].startswith("derived: H800 figure"), term


def test_h100_prices_deepseeks_gemms_at_deepgemms_h800_rows():
    """Same SM, same HBM: the 2112 x 7168 weight at m=128 runs at the row's 352 TFLOPS."""
    hw = load_hardware("h100")
    assert hw.gemm_time(128, 2112, 7168) == pytest.approx(2 * 128 * 2112 * 7168 / 352e12, rel=1e-12)
    assert hw.gemm_time(4096, 7168, 16384) == pytest.approx(2 * 4096 * 7168 * 16384 / 1358e12, rel=1e-12)


def test_h200_takes_a_memory_bound_rows_bytes_at_its_own_hbm():
    """m=64 on the 7168 x 16384 weight: 336 TFLOPS on H800 = 44.739 us, of which its 119.4 MB at
    3.35 TB/s x 0.80 take 44.555 us; at 4.8 TB/s x 0.80 they take 31.096 us (the compute floor,
    10.85 us, is under both): 31.280 us on H200. A compute-bound row (m=4096) is unchanged."""
    hw = load_hardware("h200")
    assert hw.gemm_time(64, 7168, 16384) == pytest.approx(31.280e-6, rel=1e-4)
    bytes_ = 7168 * 16384 + 64 * 16384 + 64 * 7168 * 2
    h800_time = 2 * 64 * 7168 * 16384 / 336e12
    assert hw.gemm_time(64, 7168, 16384) == pytest.approx(h800_time - bytes_ / 2.68e12 + bytes_ / 3.84e12, rel=1e-12)
    assert hw.gemm_time(4096, 7168, 16384) == pytest.approx(2 * 4096 * 7168 * 16384 / 1358e12, rel=1e-12)


def test_h200_prices_the_profiles_elementwise_passes_at_its_hbm():
    """The MLP's pre-norm (adding the residual, one kernel): 4 of the model's 11 passes, scaled to
    the profile's 58.5, for 4,096 tokens of hidden 7168 in BF16: 4096 x 7168 x 2 x 4 x 58.5/11 B
    over 4.8 TB/s x 0.80."""
    costs = OpCosts(model_shape("deepseek-v3"), load_hardware("h200"), Layout(ep=32, decode=False, low_latency=False))
    expected = 4096 * 7168 * 2 * 4 * 58.5 / 11 / 3.84e12
    assert costs.compute("comm_prepare_mlp", UBatchWork(4096, 1, 4096 * 4096)) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(325.30e-6, rel=1e-4)


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_hopper_transfers_carry_the_h800_kernel_terms(name):
    """Decode: a 64-token low-latency combine spends 39 us x 64/128 on the compute stream and the
    rest of its call in flight. Prefill across nodes under overlap: a dispatch at 0.793 of
    DeepEP's EP32 58 GB/s plus a barrier of 0.276 of its time at 58 GB/s."""
    hw, shape, work = load_hardware(name), model_shape("deepseek-v3"), UBatchWork(64, 64, 64 * 4096)
    decode = OpCosts(shape, hw, Layout(ep=128, decode=True, low_latency=True), overlapped=True)
    assert decode.send_kernel("combine", work) == pytest.approx(19.5e-6, rel=1e-12)
    call = hw.transfer_time("combine", decode.transfer_bytes("combine", work), ep=128, low_latency=True)
    assert decode.transfer("combine", work) == pytest.approx(call - 19.5e-6, rel=1e-12)
    prefill = OpCosts(shape, hw, Layout(ep=32, decode=False, low_latency=False), overlapped=True)
    big = UBatchWork(8192, 2, 8192 * 4096)
    at_table = prefill.transfer_bytes("dispatch", big) / 58e9
    assert prefill.transfer("dispatch", big) == pytest.approx(at_table / 0.793 + 0.276 * at_table, rel=1e-12)
    assert hw.ubatch_switch_s == 4.7e-6


def test_b200_keeps_the_curve_and_its_own_figures():
    """No SM100 table: the 2112 x 7168 weight at m=128 is priced by the curve under the roofline,
    max(FLOPs / (4.5 PFLOPS x 0.70 x 128/256), bytes / (8 TB/s x 0.80)) = its 16.6 MB at 6.4 TB/s."""
    hw = load_hardware("b200")
    bytes_ = 2112 * 7168 + 128 * 7168 + 128 * 2112 * 2
    assert hw.gemm_time(128, 2112, 7168) == pytest.approx(bytes_ / 6.4e12, rel=1e-12)
    notes = json.loads(resources.files("tandem.simulate").joinpath("hardware", "b200.json").read_text())["notes"]
    assert all(term in notes for term in TERMS)
