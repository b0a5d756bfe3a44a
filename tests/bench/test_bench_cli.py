"""`tandem bench` and `tandem tune` end to end on tiny sizes (real subprocesses, two gloo
ranks), and the thresholds file round-trip into `serve`'s configuration."""

import json
import subprocess
import sys

import pytest

from tandem.bench.tune import NEVER, choose_threshold
from tests.support.cli import PNG_MAGIC, run_cli

ROW_KEYS = {"mode", "tokens_per_rank", "step_ms", "compute_ms", "comm_ms", "floor_ms"}


@pytest.mark.slow
def test_bench_writes_json_and_png(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = run_cli(
        "bench", "--tokens", "4,8", "--modes", "none,dbo,dbo-greenlet", "--repeat", "2", "--warmup", "0",
        "--fabric-latency-us", "200", "--json", str(out), "--plot", str(png),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["mode"], r["tokens_per_rank"]) for r in rows} == {(m, t) for m in ("none", "dbo", "dbo-greenlet") for t in (4, 8)}
    for r in rows:
        assert ROW_KEYS <= r.keys()
        assert r["step_ms"] > 0 and r["compute_ms"] > 0 and r["comm_ms"] > 0
        assert r["floor_ms"] == pytest.approx(max(r["compute_ms"], r["comm_ms"]), abs=1e-3)
        assert 0 <= r["time_model"]["overlap_efficiency"] <= 1
    assert data["config"]["data_parallel_size"] == 2
    assert data["config"]["fabric_model"]["latency_us"] == pytest.approx(200)
    assert png.read_bytes()[:8] == PNG_MAGIC
    # The table: one block per size, with the floor and the time-model columns.
    assert "floor" in result.stdout and "overlap" in result.stdout and "dbo-greenlet" in result.stdout
    # No overlap exposes its communication: the 2 x 200 µs modelled transfers per MoE layer.
    none = [r for r in rows if r["mode"] == "none"]
    assert all(r["time_model"]["recv_wait_ms"] >= 0.4 for r in none)


@pytest.mark.slow
def test_bench_moe_stack_with_a_preset(tmp_path):
    out = tmp_path / "stack.json"
    result = run_cli(
        "bench", "--model", "moe-stack", "--tokens", "8", "--modes", "none,dbo,sbo,sbo-combine-down-gemm,tbo,auto", "--repeat", "1", "--warmup", "0",
        "--fabric", "deepep-ll-h800", "--json", str(out),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["rows"]] == ["none", "dbo", "sbo", "sbo-combine-down-gemm", "tbo", "auto"]
    assert data["config"]["fabric"] == "deepep-ll-h800"


@pytest.mark.slow
def test_bench_rejects_bad_flags():
    result = run_cli("bench", "--modes", "none,turbo")
    assert result.returncode != 0 and "turbo" in result.stderr
    result = run_cli("bench", "--fabric", "warp-drive")
    assert result.returncode != 0 and "warp-drive" in result.stderr


@pytest.mark.slow
def test_plot_without_matplotlib_is_a_clear_error(tmp_path):
    # Hide matplotlib from the child: the import fails before any rank starts.
    code = (
        "import sys; sys.modules['matplotlib'] = None; from tandem.cli import app; "
        f"app(['bench', '--tokens', '4', '--plot', '{tmp_path / 'x.png'}'])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "matplotlib" in result.stderr and "tandem[plot]" in result.stderr


@pytest.mark.slow
def test_tune_writes_thresholds_that_serve_reads(tmp_path, monkeypatch):
    out = tmp_path / "thresholds.json"
    result = run_cli(
        "tune", "--output", str(out), "--decode-tokens", "4,8", "--prefill-tokens", "16,32", "--repeat", "1",
        "--warmup", "0", "--fabric-latency-us", "100",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    decode, prefill = data["dbo_decode_token_threshold"], data["dbo_prefill_token_threshold"]
    assert decode in (4, 8, NEVER) and prefill in (16, 32, NEVER)
    assert "recommended: --enable-dbo" in result.stdout and f"--dbo-decode-token-threshold {decode}" in result.stdout
    assert {p for p in data["sweep"]} == {"decode", "prefill"}

    # Round trip through `tandem serve`'s own flag parsing into the engine configuration.
    from typer.testing import CliRunner

    import tandem.serving.server as server
    from tandem.cli import app

    seen = {}
    monkeypatch.setattr(server, "run_server", lambda config, options, http: seen.setdefault("config", config))
    cli = CliRunner().invoke(app, ["serve", "--enable-dbo", "--thresholds-file", str(out), "--port", "0"])
    assert cli.exit_code == 0, cli.output
    overlap = seen["config"].overlap
    assert (overlap.dbo_decode_token_threshold, overlap.dbo_prefill_token_threshold) == (decode, prefill)
    assert "thresholds decode=" in server.describe(seen["config"], server.ServeOptions(), server.HttpOptions(), 1)


def test_choose_threshold_needs_wins_at_every_larger_size():
    # DBO wins at 8 (lucky), loses at 16, wins from 32 on: the threshold is 32.
    sizes = [(4, 10, 11), (8, 10, 9), (16, 10, 10), (32, 20, 15), (64, 40, 30)]
    assert choose_threshold("decode", sizes, 0.03).threshold == 32
    # Within the margin is not a win.
    assert choose_threshold("decode", [(4, 10, 9.8), (8, 10, 9.9)], 0.03).threshold == NEVER
    assert choose_threshold("decode", [(4, 10, 9.8), (8, 10, 9.9)], 0.0).threshold == 4
    # Losing at the largest size: never.
    assert choose_threshold("prefill", [(64, 10, 5), (128, 10, 12)], 0.03).threshold == NEVER


def test_overlap_policy_and_split_flags_reach_the_engine_config(monkeypatch):
    from typer.testing import CliRunner

    import tandem.serving.server as server
    from tandem.cli import app

    seen = {}
    monkeypatch.setattr(server, "run_server", lambda config, options, http: seen.setdefault("config", config))
    args = ["serve", "--enable-dbo", "--overlap-policy", "auto", "--ubatch-split", "balanced-cost", "--port", "0"]
    cli = CliRunner().invoke(app, args)
    assert cli.exit_code == 0, cli.output
    assert (seen["config"].overlap.overlap_policy, seen["config"].overlap.ubatch_split) == ("auto", "balanced-cost")
    bad = CliRunner().invoke(app, ["serve", "--overlap-policy", "sometimes", "--port", "0"])
    assert bad.exit_code != 0 and "--overlap-policy" in bad.output
