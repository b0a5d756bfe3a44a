"""The compiled step (`--compile`): attention and the MoE layers stay opaque to dynamo, the
in-place CPU decode attention equals the gathered one, and a compiled model gives eager's
greedy tokens per family. The engine-level runs (inductor, DBO/TBO/SBO, no recompiles, the
cache) are in tests/worker/test_compiled_runner.py."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.models.compiled import CompiledModel, cache_dir_for, resolve_compile
from tandem.models.cpu_decode_attention import cpu_decode_attention
from tandem.models.paged_attention import AttentionMetadata, _decode_attention, paged_attention
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


def _decode_case(dtype, requests, kv_heads, heads, dim, value_dim=None, lengths=None):
    torch.manual_seed(0)
    block_size, width = 4, 5
    blocks = requests * width + 1
    key_cache = torch.randn(blocks, block_size, kv_heads, dim, dtype=dtype)
    value_cache = key_cache[..., :value_dim] if value_dim else torch.randn(blocks, block_size, kv_heads, dim, dtype=dtype)
    table = (torch.randperm(blocks - 1)[: requests * width].view(requests, width) + 1).int()
    lens = torch.tensor(lengths if lengths else torch.randint(1, width * block_size + 1, (requests,)).tolist(), dtype=torch.int32)
    query = torch.randn(requests, heads, dim, dtype=dtype)
    metadata = AttentionMetadata(
        torch.arange(requests + 1, dtype=torch.int32), lens, 1, torch.zeros(requests, dtype=torch.long), table,
        block_size, decode_only=True, query_start_loc_host=tuple(range(requests + 1)), seq_lens_host=tuple(lens.tolist()),
    )
    return query, key_cache, value_cache, metadata


@pytest.mark.parametrize(
    "dtype,requests,kv_heads,heads,dim,value_dim,lengths",
    [
        (torch.float32, 5, 2, 4, 16, None, None),  # GQA
        (torch.float32, 1, 2, 4, 16, None, [3]),  # one request, one block: padded to two inside
        (torch.float32, 3, 1, 4, 24, 16, [9, 0, 20]),  # MLA's latent: values are the keys' first channels; a padding request
        (torch.bfloat16, 4, 2, 2, 16, None, None),
    ],
)
def test_in_place_decode_attention_equals_the_gathered_one(dtype, requests, kv_heads, heads, dim, value_dim, lengths):
    query, key_cache, value_cache, metadata = _decode_case(dtype, requests, kv_heads, heads, dim, value_dim, lengths)
    scale = dim**-0.5
    expected = _decode_attention(query, key_cache, value_cache, metadata, scale)
    got = paged_attention(query, key_cache, value_cache, metadata, scale, compiled_decode=True)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    assert got.dtype == dtype and got.shape == (requests, heads, value_dim or dim)
    if lengths and 0 in lengths:
        assert not got[lengths.index(0)].any()


def test_in_place_decode_attention_compiles_once_for_every_batch_and_width():
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    for requests, width in ((2, 2), (7, 3), (1, 1), (12, 5)):
        query, key_cache, value_cache, metadata = _decode_case(torch.float32, requests, 2, 4, 16)
        cpu_decode_attention(query, key_cache, value_cache, metadata.block_table[:, :width], metadata.seq_lens.clamp(max=width * 4), 0.25)
    assert counters["stats"]["unique_graphs"] - before <= 1


def test_compile_setting_is_checked_and_resolved_per_device():
    from tandem.config import OverlapConfig

    with pytest.raises(ValueError, match="--compile must be one of auto, on, off, got 'yes'"):
        EngineConfig(compile="yes")
    with pytest.raises(ValueError, match="--compile on cannot run with --ubatch-executor greenlet"):
        EngineConfig(compile="on", overlap=OverlapConfig(enable_dbo=True, executor="greenlet"))
    assert not resolve_compile("auto", torch.device("cpu"), greenlet_ubatches=True)
    assert resolve_compile("on", torch.device("cpu")) and not resolve_compile("off", torch.device("cpu"))
    assert resolve_compile("auto", torch.device("cpu")) is False  # measured: README, "The compiled step"


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
