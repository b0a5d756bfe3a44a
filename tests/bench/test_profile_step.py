"""`tandem profile` on the CPU (tiny-moe, a small batch): the table's rows, and the relations
the figures must keep whatever the machine's speed — kernels counted inside the modules,
module times inside their parents' and the step's, a positive weight-bandwidth floor."""

import json

import pytest
import torch

ROWS = {
    "scheduler", "plan", "step inputs", "forward", "embed", "layers.*", "layers.*.input_layernorm",
    "layers.*.self_attn", "layers.*.post_attention_layernorm", "layers.*.mlp", "layers.*.mlp.router_logits",
    "layers.*.mlp.select", "layers.*.mlp.experts", "layers.*.mlp.shared_experts", "norm", "sample", "lm_head", "read samples", "apply",
}
#: Hook and clock overhead a parent's span does not cover (its children's marks are inside it).
SLACK = 1.05


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from typer.testing import CliRunner

    from tandem.cli import app

    out = tmp_path_factory.mktemp("profile") / "profile.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine: one thread keeps OpenMP from spinning against others
    try:
        result = CliRunner().invoke(app, [
            "profile", "--model", "tiny-moe", "--device", "cpu", "--batch", "2", "--prompt-len", "8",
            "--decode-steps", "1", "--repeat", "1", "--json", str(out),
        ], terminal_width=200)
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.stdout


def test_table_has_a_row_per_region_and_phase(report):
    data, stdout = report
    assert set(data["phases"]) == {"prefill", "decode"}
    for phase in data["phases"].values():
        assert {r["row"] for r in phase["rows"]} == ROWS
    assert "## prefill: 16 tokens" in stdout and "## decode: 2 tokens" in stdout
    assert "|       routed experts | device | 2 |" in stdout  # indented under feed-forward, one call per MoE layer


def test_rows_measure_the_step_they_ran(report):
    data, _ = report
    model_layers = 3  # tiny-moe: one dense layer, then two MoE layers
    for name, phase in data["phases"].items():
        rows = {r["row"]: r for r in phase["rows"]}
        assert phase["tokens"] == {"prefill": 16, "decode": 2}[name]
        assert phase["decoder_layers"] == model_layers
        assert rows["layers.*"]["calls"] == model_layers and rows["layers.*.self_attn"]["calls"] == model_layers
        assert rows["layers.*.mlp.experts"]["calls"] == 2
        # Kernels: every compute row launched some; a parent's count includes its children's.
        for key in ("forward", "layers.*.self_attn", "layers.*.mlp", "layers.*.mlp.experts", "lm_head"):
            assert rows[key]["kernels"] > 0, key
        for key, row in rows.items():
            kids = [r for r in phase["rows"] if r["parent"] == key]
            if kids:
                assert sum(k["kernels"] for k in kids) <= row["kernels"], key
                assert sum(k["ms"] for k in kids) <= row["ms"] * SLACK, key
        top = [r for r in phase["rows"] if r["parent"] is None]
        assert sum(r["ms"] for r in top) <= phase["step_ms"] * SLACK
        assert phase["kernels_per_step"] >= rows["forward"]["kernels"] + rows["sample"]["kernels"]
        assert phase["kernels_per_decoder_layer"] == pytest.approx(rows["layers.*"]["kernels"] / model_layers)
        # The floor: weights read once at the bandwidth measured in this run.
        assert phase["weight_floor_ms"] > 0 and phase["step_over_weight_floor"] > 1
        assert rows["layers.*.self_attn"]["kv_bytes"] > 0 and rows["layers.*.self_attn"]["flops"] > 0
        assert rows["lm_head"]["weight_bytes"] > 0 and rows["scheduler"]["flops"] == 0


def test_experts_read_only_the_experts_the_router_picked(report):
    """Two decode tokens x top-k cannot touch every expert; the prefill's 16 x top-k may."""
    from tandem.models.tiny_moe import CONFIG

    data, _ = report
    experts = {p: {r["row"]: r for r in data["phases"][p]["rows"]}["layers.*.mlp.experts"] for p in ("prefill", "decode")}
    assert 0 < experts["decode"]["weight_bytes"] < experts["prefill"]["weight_bytes"]
    per_expert = 3 * CONFIG["hidden_size"] * CONFIG["moe_intermediate_size"] * 4  # float32 gate, up, down
    touched = experts["decode"]["weight_bytes"] / per_expert
    assert touched == pytest.approx(round(touched)) and touched <= 2 * 2 * CONFIG["num_experts_per_tok"]


def test_roofline_is_measured_in_the_run(report):
    data, _ = report
    r = data["roofline"]
    assert r["device"] == "cpu" and r["bandwidth_bytes_per_s"] > 0 and r["matmul_flops_per_s"] > 0
    # gpu-review-3 G7: weights are only read, so their floor uses the read-only rate; the
    # copy's floor is printed beside it.
    assert r["read_bandwidth_bytes_per_s"] > 0
    decode = data["phases"]["decode"]
    assert decode["weight_floor_ms"] == pytest.approx(1000 * decode["weight_bytes"] / r["read_bandwidth_bytes_per_s"])
    assert decode["weight_floor_at_copy_rate_ms"] == pytest.approx(1000 * decode["weight_bytes"] / r["bandwidth_bytes_per_s"])


def test_a_mixtral_checkpoint_has_its_feed_forward_rows(tmp_path):
    """Mixtral's layers hold their MoE block as `block_sparse_moe`: the table still times it
    as the feed-forward, with its router and experts rows."""
    pytest.importorskip("transformers")
    from tandem.bench.profile_step import run_profile
    from tandem.config import EngineConfig
    from tests.support.hf_checkpoints import COMMON, build_hf_model, save_checkpoint

    directory = save_checkpoint(build_hf_model("mixtral"), tmp_path / "mixtral")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = run_profile(EngineConfig(model=str(directory), device="cpu"), batch=2, prompt_len=8,
                             decode_steps=1, repeat=1, roofline_sizes={"copy_mib": 8, "matmul_size": 256})
    finally:
        torch.set_num_threads(threads)
    rows = {r["row"]: r for r in report["phases"]["decode"]["rows"]}
    layers = COMMON["num_hidden_layers"]
    for key in ("layers.*.mlp", "layers.*.mlp.router_logits", "layers.*.mlp.experts"):
        assert rows[key]["calls"] == layers, key
    assert 0 < rows["layers.*.mlp.experts"]["ms"] <= rows["layers.*.mlp"]["ms"] * SLACK


def test_dbo_greenlet_steps_count_each_ubatch():
    """Under DBO each module runs once per ubatch, the two interleaving at their yields: every
    call is timed and counted on its own (the greenlets share the thread the counter watches)."""
    from tandem.bench.profile_step import run_profile
    from tandem.config import EngineConfig, OverlapConfig

    overlap = OverlapConfig(enable_dbo=True, executor="greenlet", dbo_decode_token_threshold=0,
                            dbo_prefill_token_threshold=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = run_profile(EngineConfig(model="tiny-moe", device="cpu", overlap=overlap), batch=2, prompt_len=8,
                             decode_steps=1, repeat=1, roofline_sizes={"copy_mib": 8, "matmul_size": 256})
    finally:
        torch.set_num_threads(threads)
    rows = {r["row"]: r for r in report["phases"]["decode"]["rows"]}
    assert rows["forward"]["calls"] == 1 and rows["layers.*"]["calls"] == 2 * 3
    assert rows["layers.*.mlp.experts"]["calls"] == 2 * 2
    assert 0 < rows["layers.*"]["kernels"] <= rows["forward"]["kernels"]


def test_kernel_counts_split_aten_and_triton_and_the_gpu_pass_is_skipped_on_cpu(report):
    """On the CPU every fused op takes its torch path: no Triton launches, and the rows' kernel
    figure is the ATen count; the torch.profiler pass is CUDA's only, a one-line note here."""
    data, stdout = report
    for phase in data["phases"].values():
        assert phase["triton_launches_per_step"] == 0 and phase["triton_by_kernel"] == {}
        assert phase["kernels_per_step"] == phase["aten_kernels_per_step"] + phase["triton_launches_per_step"]
        assert phase["kernels_per_decoder_layer"] == pytest.approx(
            phase["aten_kernels_per_decoder_layer"] + phase["triton_launches_per_decoder_layer"])
        for row in phase["rows"]:
            assert row["kernels"] == row["aten_kernels"] + row["triton_launches"], row["row"]
        assert phase["gpu_kernels"] is None
    assert "| kernels | of which Triton |" in stdout
    assert " ATen + 0 Triton)" in stdout
    assert stdout.rstrip().splitlines()[-1] == "GPU kernels (torch.profiler): skipped, the device is not CUDA"


def test_the_compiled_step_reads_the_weights_the_eager_step_reads(monkeypatch):
    """The weight-bandwidth floor is what a step must read, whatever runs it: module hooks do
    not fire inside the compiled graph, yet the compiled profile's weight bytes, per row and per
    step, equal the eager profile's. Compile is forced on with dynamo's aot_eager backend (the
    same graph and hooks as inductor, no code generation, so the test stays fast)."""
    from tandem.bench.profile_step import run_profile
    from tandem.config import EngineConfig
    from tandem.models.compiled import CompiledModel

    def profile() -> dict:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run_profile(EngineConfig(model="tiny-moe", device="cpu"), batch=2, prompt_len=8, decode_steps=1,
                               repeat=1, roofline_sizes={"copy_mib": 8, "matmul_size": 256})
        finally:
            torch.set_num_threads(threads)

    eager = profile()
    monkeypatch.setattr(CompiledModel, "for_config", classmethod(lambda cls, model, config, device: cls(model, backend="aot_eager")))
    try:
        compiled = profile()
    finally:
        # After a compiled profile, the next compile in the same process traced into the CPU
        # ops' Python implementations (tests/models/test_compiled.py failed after this test):
        # dynamo's caches are per process, and this test is not what the others test.
        torch._dynamo.reset()
    assert not eager["compiled"] and compiled["compiled"]
    for name, phase in compiled["phases"].items():
        rows = {r["row"]: r for r in phase["rows"]}
        assert rows["layers.*.self_attn"]["calls"] == 0  # not timed: its hooks are inside the graph
        assert phase["weight_bytes"] == eager["phases"][name]["weight_bytes"], name
        for row in eager["phases"][name]["rows"]:
            for column in ("weight_bytes", "kv_bytes", "flops"):
                assert rows[row["row"]][column] == row[column], (name, row["row"], column)
