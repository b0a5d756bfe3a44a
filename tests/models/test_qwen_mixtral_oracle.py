"""Qwen2-MoE, Qwen3-MoE and Mixtral against transformers: prefill logits, greedy decode over
the paged KV cache, batching, and both checkpoint layouts (per-expert and fused)."""

import pytest
import torch

from tandem.models import ModelInfo
from tandem.models.layers import MoEBlock
from tandem.models.loader import load_model
from tandem.models.mixtral import MixtralForCausalLM
from tandem.models.qwen_moe import Qwen2MoeForCausalLM, Qwen2MoeSparseBlock, Qwen3MoeForCausalLM
from tandem.testing.model_harness import GreedyHarness
from tests.support.hf_checkpoints import EOS, FAMILIES, build_hf_model, hf_logits, save_checkpoint, save_fused_checkpoint

TOL = 1e-4
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]  # "Hello, world!"
OTHER = [3, 141, 59, 26, 53]
CLASSES = {"qwen2_moe": Qwen2MoeForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(family, HF model, loaded ModelInfo) from a `save_pretrained` directory."""
    hf = build_hf_model(request.param)
    directory = save_checkpoint(hf, tmp_path_factory.mktemp(request.param))
    return request.param, hf, load_model(str(directory))


def _max_diff(a, b):
    return float((a.float() - b.float()).abs().max())


def test_loaded_model_info(family):
    name, hf, info = family
    assert isinstance(info, ModelInfo)
    assert type(info.model) is CLASSES[name]
    assert info.model.architectures == (type(hf).__name__,)
    assert info.eos_token_ids == {EOS}
    assert info.max_model_len == 256
    assert info.tokenizer.decode(info.tokenizer.encode("Hello, world!").ids) == "Hello, world!"
    assert info.tokenizer.encode("Hello, world!").ids == PROMPT


def test_block_structure(family):
    name, hf, info = family
    mlps = [getattr(layer, layer.mlp_name) for layer in info.model.model.layers]
    if name == "qwen2_moe":
        assert not isinstance(mlps[0], MoEBlock)  # mlp_only_layers=[0]
        assert isinstance(mlps[1], Qwen2MoeSparseBlock) and mlps[1].kernel.shared_experts is not None
    else:
        assert all(isinstance(m, MoEBlock) for m in mlps)
    experts = {"qwen2_moe": 4, "qwen3_moe": 4, "mixtral": 8}[name]
    moe = next(m for m in mlps if isinstance(m, MoEBlock))
    assert tuple(moe.experts.w13.shape) == (experts, 2 * 32, 64)  # [E, 2I, H], I = 32 in every family
    assert tuple(moe.experts.w2.shape) == (experts, 64, 32)


def test_prefill_and_greedy_decode_match_transformers(family):
    name, hf, info = family
    harness = GreedyHarness(info.model, num_blocks=32, block_size=4)
    seq = {"tokens": list(PROMPT), "computed": 0}
    logits = harness.step([seq])
    reference = hf_logits(hf, seq["tokens"])
    assert logits.shape == reference.shape
    assert _max_diff(logits, reference) < TOL
    assert float(reference.std()) > 0.05  # the comparison is not between near-constant logits
    for _ in range(6):
        seq["tokens"].append(int(logits[-1].argmax()))
        logits = harness.step([seq])
        assert logits.shape[0] == 1
        reference = hf_logits(hf, seq["tokens"])[-1:]
        assert _max_diff(logits, reference) < TOL
        assert int(logits[-1].argmax()) == int(reference[-1].argmax())


def test_batched_step_equals_separate_runs(family):
    name, hf, info = family
    separate = {}
    for key, prompt in (("a", PROMPT), ("b", OTHER)):
        harness = GreedyHarness(info.model, num_blocks=32, block_size=4)
        seq = {"tokens": list(prompt), "computed": 0}
        prefill = harness.step([seq])
        seq["tokens"].append(7)
        separate[key] = (prefill, harness.step([seq]))

    harness = GreedyHarness(info.model, num_blocks=32, block_size=4)
    a, b = {"tokens": list(PROMPT), "computed": 0}, {"tokens": list(OTHER), "computed": 0}
    prefill = harness.step([a, b])
    assert _max_diff(prefill[: len(PROMPT)], separate["a"][0]) < 1e-5
    assert _max_diff(prefill[len(PROMPT) :], separate["b"][0]) < 1e-5
    a["tokens"].append(7)
    b["tokens"].append(7)
    decode = harness.step([a, b])
    assert _max_diff(decode[0:1], separate["a"][1]) < 1e-5
    assert _max_diff(decode[1:2], separate["b"][1]) < 1e-5
    # A mixed step: one request prefills while the other decodes.
    c = {"tokens": list(OTHER), "computed": 0}
    a["tokens"].append(9)
    mixed = harness.step([a, c])
    assert _max_diff(mixed[0], hf_logits(hf, a["tokens"])[-1]) < TOL
    assert _max_diff(mixed[1:], hf_logits(hf, OTHER)) < TOL


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fused_transformers5_layout_loads(name, tmp_path):
    hf = build_hf_model(name, seed=1)
    info = load_model(str(save_fused_checkpoint(hf, tmp_path)))
    assert any(n.endswith("experts.gate_up_proj") for n in info.model.checkpoint_tensors_read)
    harness = GreedyHarness(info.model, num_blocks=16, block_size=4)
    seq = {"tokens": list(OTHER), "computed": 0}
    assert _max_diff(harness.step([seq]), hf_logits(hf, OTHER)) < TOL


def test_dict_config_and_direct_load_weights():
    hf = build_hf_model("mixtral", seed=2)
    model = MixtralForCausalLM(hf.config.to_dict())
    loaded = model.load_weights(hf.state_dict().items())
    assert loaded == {n for n, _ in model.named_parameters()}
    harness = GreedyHarness(model, num_blocks=16, block_size=4)
    assert _max_diff(harness.step([{"tokens": list(OTHER), "computed": 0}]), hf_logits(hf, OTHER)) < TOL


def test_forward_without_metadata_or_cache_is_a_clear_error():
    hf = build_hf_model("qwen3_moe")
    model = Qwen3MoeForCausalLM(hf.config.to_dict())
    with pytest.raises(RuntimeError, match="bind_kv_cache"):
        model(torch.tensor([1, 2]), torch.tensor([0, 1]))
    GreedyHarness(model)  # binds caches
    with pytest.raises(RuntimeError, match="AttentionMetadata"):
        model(torch.tensor([1, 2]), torch.tensor([0, 1]))
