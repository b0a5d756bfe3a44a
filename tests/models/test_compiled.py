"""The compiled step (`--compile`): attention and the MoE layers stay opaque to dynamo and a
compiled model gives eager's greedy tokens per family. The engine-level runs (inductor, DBO/TBO/SBO, no recompiles, the
cache) are in tests/worker/test_compiled_runner.py."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.models.compiled import CompiledModel, cache_dir_for, inductor_patches, resolve_compile
from tandem.models.tiny_moe import build_tiny_moe
from tandem.testing.model_harness import GreedyHarness


def _recording_backend(graphs: list):
    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    return backend


def test_attention_and_moe_are_single_opaque_calls_in_one_graph(monkeypatch):
    """fullgraph: no graph break anywhere in the stack; each attention and each MoE layer is
    one call of its custom op, and nothing of paged attention or the kernel is traced."""
    model = build_tiny_moe().model
    graphs: list = []
    monkeypatch.setattr(torch._dynamo, "lookup_backend", lambda name: _recording_backend(graphs))
    compiled = CompiledModel(model, backend="recording")
    harness = GreedyHarness(model, num_blocks=32, block_size=4)
    harness.step([{"tokens": [5, 6, 7], "computed": 0}])
    assert compiled.graphs == 1 and len(graphs) == 1
    targets = [str(node.target).removesuffix(".default") for node in graphs[0].graph.nodes if node.op == "call_function"]
    layers = len(model.model.layers)
    moe_layers = sum(1 for m in model.modules() if hasattr(m, "moe_forward"))
    assert targets.count("tandem.attention") == layers
    assert targets.count("tandem.moe") == moe_layers >= 1
    traced_inside = ("index_select", "scaled_dot_product", "softmax", "topk", "sort", "dbo", "all_to_all")
    assert not [t for t in targets if any(name in t for name in traced_inside)]


def test_compiled_model_gives_eager_logits_and_tokens():
    """aot_eager runs the traced graph around the real ops: the same logits as eager over a
    prefill and decodes, and a one-token step."""
    eager_model = build_tiny_moe().model
    model = build_tiny_moe().model
    compiled = CompiledModel(model, backend="aot_eager")
    eager, compiled_h = GreedyHarness(eager_model, 64, 4), GreedyHarness(model, 64, 4)
    seqs = [[{"tokens": [3, 9, 27, 81], "computed": 0}, {"tokens": [4, 5], "computed": 0}] for _ in range(2)]
    for step in range(4):
        a, b = eager.step(seqs[0]), compiled_h.step(seqs[1])
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        nxt = a.view(-1, a.shape[-1]).argmax(-1)
        ends = torch.tensor([len(s["tokens"]) - s["computed"] for s in seqs[0]]).cumsum(0) - 1
        for s0, s1, t in zip(seqs[0], seqs[1], nxt[ends].tolist()):
            s0["tokens"].append(t)
            s1["tokens"].append(t)
    single = [{"tokens": [7], "computed": 0}]
    torch.testing.assert_close(compiled_h.step(single), eager.step([{"tokens": [7], "computed": 0}]), rtol=1e-4, atol=1e-4)
    assert compiled.graphs >= 1  # counted in fresh processes by tests/worker/test_compiled_runner.py


def test_compile_setting_is_checked_and_resolved_per_device():
    from tandem.config import OverlapConfig

    with pytest.raises(ValueError, match="--compile must be one of auto, on, off, got 'yes'"):
        EngineConfig(compile="yes")
    with pytest.raises(ValueError, match="--compile on cannot run with --ubatch-executor greenlet"):
        EngineConfig(compile="on", overlap=OverlapConfig(enable_dbo=True, executor="greenlet"))
    cpu, f32, bf16 = torch.device("cpu"), torch.float32, torch.bfloat16
    assert not resolve_compile("auto", cpu, bf16, greenlet_ubatches=True)
    assert resolve_compile("on", cpu, f32) and not resolve_compile("off", cpu, bf16)
    # measured (benchmarks/README.md, "The compiled step"): bfloat16 on the CPU serves faster compiled
    assert resolve_compile("auto", cpu, bf16) is True and resolve_compile("auto", cpu, f32) is False
    assert resolve_compile("auto", torch.device("cuda"), bf16) is False  # no GPU measurement yet


def test_the_cpu_step_compiles_with_a_cpp_wrapper():
    """Measured on the CPU (a C++ wrapper around the kernels saves the Python wrapper's share of
    a decode step); CUDA keeps inductor's default until a GPU measures it."""
    assert inductor_patches(torch.device("cpu")) == {"cpp_wrapper": True}
    assert inductor_patches(torch.device("cuda")) == {}
    compiled = CompiledModel(build_tiny_moe().model, backend="aot_eager")
    assert compiled.config_patches == {"cpp_wrapper": True}


def test_cache_directory_is_keyed_by_model_dtype_and_source(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_COMPILE_CACHE", str(tmp_path))
    model = build_tiny_moe().model
    cpu = torch.device("cpu")
    first = cache_dir_for(model, torch.float32, cpu)
    assert first == cache_dir_for(build_tiny_moe().model, torch.float32, cpu)
    assert first.parent == tmp_path
    assert cache_dir_for(model, torch.bfloat16, cpu) != first
    monkeypatch.setattr("tandem.models.compiled._source_digest", lambda: "another tandem")
    assert cache_dir_for(model, torch.float32, cpu) != first


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_every_family_compiles_whole_and_keeps_its_logits(name, tmp_path):
    """Qwen2-MoE (shared experts, a dense layer), Qwen3-MoE (QK norm, tied embeddings) and
    Mixtral through the op boundary (aot_eager): one graph with no break, eager's logits over a
    prefill and greedy decodes."""
    from tandem.models.loader import load_model
    from tests.support.hf_checkpoints import build_hf_model, save_checkpoint

    directory = save_checkpoint(build_hf_model(name), tmp_path / name)
    eager_model, model = load_model(str(directory)).model, load_model(str(directory)).model
    compiled = CompiledModel(model, backend="aot_eager")
    eager, compiled_h = GreedyHarness(eager_model, 32, 4), GreedyHarness(model, 32, 4)
    a_seq, b_seq = {"tokens": [72, 101, 108, 108, 111], "computed": 0}, {"tokens": [72, 101, 108, 108, 111], "computed": 0}
    for _ in range(4):
        a, b = eager.step([a_seq]), compiled_h.step([b_seq])
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        token = int(a[-1].argmax())
        a_seq["tokens"].append(token)
        b_seq["tokens"].append(token)
    # fullgraph: a break would have raised. How many graphs depends on what this process compiled
    # before (dynamo keeps automatic-dynamic state per code object, shared by the families);
    # the runner tests count them in fresh processes.
    assert compiled.graphs >= 1
