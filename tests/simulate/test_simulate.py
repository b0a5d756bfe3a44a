"""`tandem simulate` (#31): the timing model on hand-computed cases, the schedules taken from
the runtime's code, the hardware profiles' sources, and the command. No weights, no processes."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from tandem.simulate import PROFILES, load_hardware, simulate
from tandem.simulate.schedule import YIELD, Step, issue_order, play

SIMULATE_SRC = Path(__file__).resolve().parents[2] / "src" / "tandem" / "simulate"

ATTN, EXPERTS = Step(0, "attn_core"), Step(0, "experts")
SEND_D, RECV_D = Step(0, "dispatch_send"), Step(0, "dispatch_recv")
SEND_C, RECV_C = Step(0, "combine_send"), Step(0, "combine_recv")
#: One MoE layer as DBO stages it: attention, dispatch | experts, combine | receive.
LAYER = [ATTN, SEND_D, YIELD, RECV_D, EXPERTS, SEND_C, YIELD, RECV_C]


def _cost(per_token: dict[str, float], tokens: list[int]):
    return lambda u, step: per_token[step.name] * tokens[u]


def test_none_is_the_sum_of_compute_and_comm():
    cost = _cost({"attn_core": 3.0, "experts": 5.0, "dispatch_send": 2.0, "combine_send": 4.0}, [1])
    spans = play(issue_order([LAYER], [0]), cost, sync_comm=True)
    assert max(s.end for s in spans) == 3 + 2 + 5 + 4


def test_two_ubatches_overlap_to_the_max_plus_the_unhideable_ends():
    # Half the tokens each: compute c = 1 per stage, comm m = 1 per transfer, per ubatch.
    cost = _cost({"attn_core": 1.0, "experts": 1.0, "dispatch_send": 1.0, "combine_send": 1.0}, [1, 1])
    spans = play(issue_order([LAYER, LAYER], [0, 0]), cost, sync_comm=False)
    compute = sum(s.end - s.start for s in spans if s.lane == "compute")
    comm = sum(s.end - s.start for s in spans if s.lane == "comm")
    assert (compute, comm) == (4.0, 4.0)
    # The first attention has nothing to hide behind (comm idle), the rest is perfectly hidden.
    assert max(s.end for s in spans) == max(compute, comm) + 1.0
    none = play(issue_order([LAYER], [0]), _cost({"attn_core": 1.0, "experts": 1.0, "dispatch_send": 1.0, "combine_send": 1.0}, [2]), sync_comm=True)
    assert max(s.end for s in none) == compute + comm


def test_dbo_with_one_ubatch_is_none():
    sim = simulate("small-moe", "h800", ep=16, phase="prefill", tokens_per_rank=1024, context=256, modes=["none", "dbo1"])
    none, one = sim.results
    assert one.step_s == none.step_s and one.spans == none.spans


def test_dbo_overlaps_when_comm_and_compute_are_close():
    sim = simulate("deepseek-v3", "h800", ep=32, phase="prefill", tokens_per_rank=8192, modes=["none", "dbo", "tbo"])
    none, dbo, tbo = sim.results
    for r in (dbo, tbo):
        assert r.floor_s <= r.step_s < none.step_s
    assert none.step_s == pytest.approx(none.compute_s + none.comm_s)


def test_changing_a_tbo_operation_list_changes_the_timeline(monkeypatch):
    from tandem.models import layer_operations
    from tandem.models.layer_operations import DecoderLayerOperations

    def run():
        return simulate("deepseek-v3", "h800", ep=128, phase="decode", tokens_per_rank=128, modes=["tbo"]).results[0]

    base = run()
    monkeypatch.setattr(layer_operations, "DECODE_DELTA_STAGES", 1)
    shifted = run()
    assert shifted.step_s != base.step_s
    monkeypatch.undo()

    original = DecoderLayerOperations.operations_strategy

    def shared_experts_last(self, decode):
        strategy = original(self, decode)
        ops = [op for op in strategy.operations if getattr(op, "__name__", "") != "op_shared_experts"]
        if len(ops) != len(strategy.operations):
            ops.insert(len(ops) - 2, self.op_shared_experts)
        return type(strategy)(ops, strategy.delta_stages)

    monkeypatch.setattr(DecoderLayerOperations, "operations_strategy", shared_experts_last)
    moved = run()
    order = lambda r: [(s.ubatch, s.step) for s in sorted(r.spans, key=lambda s: (s.start, s.lane))]
    assert order(moved) != order(base)
    assert moved.step_s != base.step_s


@pytest.mark.parametrize("name", PROFILES)
def test_every_figure_of_every_profile_has_a_source(name):
    hw = load_hardware(name)
    raw = json.loads((SIMULATE_SRC / "hardware" / f"{name}.json").read_text())
    assert set(hw.sources) == set(raw["figures"])
    for key, source in hw.sources.items():
        assert len(source) > 20, (name, key)
    assert hw.fp8_flops > hw.bf16_flops > 0 and hw.hbm_bytes_per_s > 0


def test_a_figure_without_a_source_is_refused(tmp_path):
    raw = json.loads((SIMULATE_SRC / "hardware" / "h800.json").read_text())
    raw["figures"]["sms"]["source"] = ""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="'sms' needs a value and a source"):
        load_hardware(str(path))


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_a_figure_can_take_another_profiles_value_and_keeps_its_own_source(name):
    """H100 and H200 take DeepGEMM's H800 table by reference: one copy of the published rows."""
    hw, h800 = load_hardware(name), load_hardware("h800")
    raw = json.loads((SIMULATE_SRC / "hardware" / f"{name}.json").read_text())
    assert raw["figures"]["gemm_table"] == {"value_from": "h800", "source": hw.sources["gemm_table"]}
    assert hw.gemm_table == h800.gemm_table and len(hw.gemm_table) > 20
    assert hw.sources["gemm_table"] != h800.sources["gemm_table"]


def test_a_reference_to_a_figure_the_other_profile_lacks_is_refused(tmp_path):
    raw = json.loads((SIMULATE_SRC / "hardware" / "h100.json").read_text())
    raw["figures"]["no_such_figure"] = {"value_from": "h800", "source": "derived: a reference to nothing at all"}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="'h800' has no literal value for figure 'no_such_figure'"):
        load_hardware(str(path))


def test_the_gemm_curve_meets_deepgemm_anchors_within_15_percent():
    from tandem.simulate.hardware import HardwareProfile

    full = load_hardware("h800")  # without its table, which prices these shapes exactly
    hw = HardwareProfile(full.name, {k: v for k, v in full.figures.items() if k != "gemm_table"}, full.sources)
    for a in hw.gemm_anchors:
        seconds = hw.gemm_time(a["m"], a["n"], a["k"], groups=a["groups"])
        achieved = 2 * a["m"] * a["n"] * a["k"] * a["groups"] / seconds / 1e12
        assert abs(achieved / a["tflops"] - 1) < 0.15, a


def test_the_validation_table_is_computed_against_the_published_figures():
    from tandem.simulate import validation_rows

    rows = validation_rows()
    assert [(r["phase"], r["tokens_per_s"]) for r in rows] == [("prefill", 7839), ("decode", 2324)]
    for r in rows:  # the misses docs/simulate.md reports; this pins them from drifting further
        assert math.isfinite(r["error"]) and abs(r["error"]) < 0.5, r


def test_the_cli_prints_the_table(tmp_path):
    from typer.testing import CliRunner

    from tandem.cli import app

    args = ["simulate", "--model", "deepseek-v3", "--hardware", "h800", "--ep", "32", "--phase", "prefill",
            "--tokens-per-rank", "4096", "--modes", "none,dbo,tbo", "--trace", str(tmp_path / "t.json")]
    result = CliRunner().invoke(app, args, terminal_width=200)
    assert result.exit_code == 0, result.output
    for word in ("mode", "tok/s/GPU", "vs none", "floor ms", "none", "dbo", "tbo", "EP32"):
        assert word in result.output
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["args"]["mode"] for e in events if e["name"] == "step"} == {"none", "dbo", "tbo"}
    bad = CliRunner().invoke(app, ["simulate", "--modes", "warp"], terminal_width=200)
    assert bad.exit_code == 2 and "unknown mode 'warp'" in bad.output


def test_simulate_imports_neither_serving_nor_the_cli():
    for path in SIMULATE_SRC.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("tandem.serving", "tandem.cli")), (path.name, name)


def test_a_low_latency_call_has_a_fixed_part_beside_the_line_rate(tmp_path):
    """DeepEP's EP128 dispatch: 192 µs at 39 GB/s for its 128-token payload, on a NIC of ~50
    GB/s. At that payload the call takes the published 192 µs; at half of it (a 64-token
    ubatch) 192 x (1 - 39/50) = 42.2 µs fixed plus the half payload at 50 GB/s, not 96 µs."""
    hw = load_hardware("h800")
    payload = 39e9 * 192e-6
    assert hw.transfer_time("dispatch", payload, ep=128, low_latency=True) == pytest.approx(192e-6)
    half = hw.transfer_time("dispatch", payload / 2, ep=128, low_latency=True)
    assert half == pytest.approx(192e-6 * (1 - 39 / 50) + payload / 2 / 50e9) == pytest.approx(117.12e-6)
    # EP8's call beats the line rate (NVLink inside the node): it scales with bytes alone.
    assert hw.transfer_time("dispatch", 98e9 * 77e-6 / 2, ep=8, low_latency=True) == pytest.approx(77e-6 / 2)
    raw = json.loads((SIMULATE_SRC / "hardware" / "h800.json").read_text())
    del raw["figures"]["rdma_line_bytes_per_s"]
    path = tmp_path / "no_line_rate.json"
    path.write_text(json.dumps(raw))
    assert load_hardware(str(path)).transfer_time("dispatch", payload / 2, ep=128, low_latency=True) == pytest.approx(96e-6)


def test_the_validation_figures_this_model_gives():
    """The figures docs/simulate.md reports: with the terms read off DeepSeek's per-layer profile,
    DeepGEMM's published rates at DeepSeek's own GEMM shapes (h800.json) and decode's published
    workload (one MTP draft per request, 60 % kept), prefill +2.1 % and decode +7.0 %, both
    inside ±10 % (were +29.4 % and +13.3 %). Prefill was -1.5 % while every op of an overlapped
    mode paid for the overlap the whole step, +2.0 % once it paid only while it overlaps (decode's
    low-latency kernels take no SMs and keep their bandwidth: unchanged); decode +7.6 % until the
    residual add was priced in the next input norm, as the runtime issues it since G9; prefill
    +1.8 % until the normal kernels' overlap bandwidth and barrier were taken against the table's
    own call time, so the modelled cores and barriers are the trace's (they were 3.4-3.9 % over);
    +3.6 % until DBO followed the runtime's normal-kernel order (the send after its yield, compute
    joined to the transfer, the dispatch's CPU wait): +2.1 %."""
    from tandem.simulate import validation_rows

    errors = {r["phase"]: r["error"] for r in validation_rows()}
    assert errors == {"prefill": pytest.approx(0.0213, abs=0.001), "decode": pytest.approx(0.0704, abs=0.001)}
