"""What `tandem serve --overlap-policy auto` starts from without a tune file (#31), decided
before any rank starts: the hardware the simulator takes for the device the ranks run on, the
model it can or cannot shape, and when the command leaves the config as it is. No host is
measured here: `here` stands in as a profile with given figures (tests.support.host_profiles)."""

from __future__ import annotations

import json

import pytest

from tandem.config import EngineConfig, OverlapConfig, ParallelConfig
from tandem.simulate.serve_prior import (
    PRIOR_CONTEXTS,
    PRIOR_GRIDS,
    hardware_for_device_name,
    prior_hardware,
    simulate_prior,
    with_simulated_prior,
)
from tests.support.host_profiles import given_host


@pytest.mark.parametrize("name, profile", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA H800", "h800"),
    ("NVIDIA B200", "b200"),
    ("nvidia h200 nvl", "h200"),
    ("NVIDIA GH200 480GB", None),  # Grace Hopper: not the profile's board
    ("NVIDIA H20", None),
    ("NVIDIA A100-SXM4-80GB", None),
    ("NVIDIA GeForce RTX 4090", None),
    ("H100 or H200", None),  # two profiles named: no guess
])
def test_a_cuda_device_takes_the_profile_its_name_carries(name, profile):
    assert hardware_for_device_name(name) == profile


def _h200() -> str:
    return "NVIDIA H200"


@pytest.mark.parametrize("over, hardware, reason", [
    (dict(device_type="cpu"), "here", ""),
    (dict(device_type="cuda", device_name=_h200), "h200", ""),
    (dict(device_type="cuda", device_name=lambda: "NVIDIA A100-SXM4-80GB"), None, "no built-in hardware profile for 'NVIDIA A100"),
    (dict(device_type="cpu", ranks=1), None, "one rank"),
    (dict(device_type="cpu", modelled_fabric=True), None, "modelled interconnect"),
    (dict(device_type="cpu", pipeline_stages=2), None, "not 2 pipeline stages"),
    (dict(device_type="cpu", torchrun=True), None, "tandem tune --simulate here"),
    (dict(device_type="cuda", torchrun=True, device_name=_h200), "h200", ""),
    (dict(device_type="cuda", device_name=_h200, all2all_backend="deepep_high_throughput"), "h200", ""),
    (dict(device_type="cuda", device_name=_h200, all2all_backend="torch_a2a"), None, "not the torch_a2a backend"),
])
def test_the_prior_is_simulated_on_the_hardware_the_ranks_run_on(over, hardware, reason):
    chosen, why = prior_hardware(**{"ranks": 2, **over})
    assert chosen == hardware and reason in why and bool(why) == (hardware is None)


def test_a_cuda_device_that_cannot_be_asked_gives_no_prior_and_says_why():
    def broken() -> str:
        raise RuntimeError("no driver")

    assert prior_hardware(device_type="cuda", ranks=2, device_name=broken) == (
        None, "the CUDA device's name is not known (no driver)")


def test_a_model_the_simulator_cannot_shape_gives_no_prior_and_the_reason(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    prior = simulate_prior(str(tmp_path), "h200", ranks=2, num_ubatches=2, grids={"decode": [8], "prefill": [64]},
                           contexts={"decode": 128, "prefill": 512})
    assert prior.document is None
    assert prior.message.startswith(f"auto starts with no prior: the simulator cannot model {tmp_path} (")
    assert "'llama' is not simulated" in prior.message and "\n" not in prior.message


def _auto(**overlap) -> EngineConfig:
    base = dict(enable_dbo=True, overlap_policy="auto")
    return EngineConfig(model="tiny-moe", device="cpu", overlap=OverlapConfig(**{**base, **overlap}),
                        parallel=ParallelConfig(data_parallel_size=2))


@pytest.mark.parametrize("overlap", [
    dict(overlap_prior="none"),
    dict(overlap_policy="static"),
    dict(enable_dbo=False),
])
def test_serve_keeps_the_config_when_auto_has_no_prior_to_take(overlap):
    config, lines = _auto(**overlap), []
    assert with_simulated_prior(config, log=lines.append) is config and lines == []


def test_a_thresholds_file_is_the_prior_and_nothing_is_simulated(tmp_path):
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({"dbo_decode_token_threshold": 8, "dbo_prefill_token_threshold": 64}))
    config, lines = _auto(thresholds_file=str(tuned)), []
    assert with_simulated_prior(config, log=lines.append) is config and lines == []


def test_serve_on_gloo_ranks_starts_from_this_hosts_prediction(monkeypatch):
    from tandem.simulate import host

    measured = given_host(2, small_rate=50e9, switch_s=1e-3)
    monkeypatch.setattr(host, "host_profile", lambda ranks: measured)
    lines: list[str] = []
    config = with_simulated_prior(_auto(), log=lines.append)
    document = config.overlap.simulated_prior
    assert document["config"]["simulated"] == {"model": "tiny-moe", "hardware": measured.name, "ranks": 2,
                                               "contexts": {"decode": 128, "prefill": 512}}
    assert [r["tokens_per_rank"] for r in document["sweep"]["decode"]] == [8, 16, 32, 64, 128, 256]
    assert lines[0].startswith("auto: measuring this host")
    assert lines[1].startswith("auto starts from tandem simulate --hardware here: DBO / none predicted decode 8: ")
    assert "; prefill 64: " in lines[1]
    # Only the overlap section changed: the settings the user gave are the ones served.
    assert config.overlap.dbo_decode_token_threshold == OverlapConfig().dbo_decode_token_threshold
    assert config.parallel == _auto().parallel and config.model == "tiny-moe"


def test_a_modelled_fabric_in_serving_gets_no_prior_and_says_why():
    config = _auto()
    config.parallel.fabric_gbps = 10.0
    lines: list[str] = []
    assert with_simulated_prior(config, log=lines.append) is config
    assert lines == ["auto starts with no prior: a modelled interconnect's transfers are sleeps, not this host's to predict"]


def test_overlap_prior_takes_simulate_or_none():
    with pytest.raises(ValueError, match="--overlap-prior must be one of"):
        OverlapConfig(overlap_prior="measured")


def test_the_serve_prior_is_the_document_tune_simulate_writes_by_default(tmp_path):
    """No sizes given to either: `tandem tune --simulate h800` and serve's prior sweep the same
    sizes at the same contexts and margin, so their thresholds and sweeps are one document."""
    from typer.testing import CliRunner

    from tandem.cli import app

    out = tmp_path / "tuned.json"
    result = CliRunner().invoke(app, ["tune", "--simulate", "h800", "--model", "deepseek-v3",
                                      "--data-parallel-size", "32", "--output", str(out)])
    assert result.exit_code == 0, result.output
    tuned = json.loads(out.read_text())
    prior = simulate_prior("deepseek-v3", "h800", ranks=32, num_ubatches=2, grids=PRIOR_GRIDS, contexts=PRIOR_CONTEXTS)
    assert prior.document is not None, prior.message
    for key in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold", "sweep", "margin"):
        assert prior.document[key] == tuned[key], key
