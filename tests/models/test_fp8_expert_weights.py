"""With the deep_gemm experts backend, a model's routed-expert weights are block-quantized to
fp8 once, when the model is built, and the model-dtype copies are freed (gpu-review-2 N11):
no bf16 expert weight is kept next to the fp8 one, and no copy is made in the first forward."""

from __future__ import annotations

import pytest
import torch

from tandem.modular_kernels import MoEConfig
from tandem.models.random_deepseek import build_random_deepseek_v2_lite
from tandem.modular_kernels import BlockFP8Weight
from tandem.testing import fake_deep_gemm

FP8 = torch.float8_e4m3fn
E, H, I = 8, 128, 128
#: DeepGEMM's blocks are 128 wide: hidden and expert intermediate sizes of one block each.
SMALL = dict(hidden_size=H, intermediate_size=256, moe_intermediate_size=I, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
             n_routed_experts=E, vocab_size=320, max_position_embeddings=256)
#: the fp8 pipeline against the unquantized torch experts (tests/modular_kernels/test_backend_matrix.py).
FP8_REL_TOL = 8e-2


@pytest.fixture
def deep_gemm():
    with fake_deep_gemm.installed() as module:
        yield module


def _moe_blocks(info):
    return [layer.mlp for layer in info.model.model.layers if layer.is_sparse]


def _expert_tensors(block):
    return dict(block.experts.named_parameters()) | dict(block.experts.named_buffers())


def test_deep_gemm_models_hold_fp8_expert_weights_and_no_bf16_copy(deep_gemm):
    info = build_random_deepseek_v2_lite(MoEConfig(moe_backend="deep_gemm"), dtype=torch.bfloat16, overrides=SMALL)
    blocks = _moe_blocks(info)
    assert len(blocks) == 1
    for block in blocks:
        tensors = _expert_tensors(block)
        assert {name: t.dtype for name, t in tensors.items()} == {
            "w13": FP8, "w13_scale": torch.float32, "w2": FP8, "w2_scale": torch.float32,
        }
        assert tensors["w13"].shape == (E, 2 * I, H) and tensors["w13_scale"].shape == (E, 2 * I // 128, H // 128)
        assert tensors["w2"].shape == (E, H, I) and tensors["w2_scale"].shape == (E, H // 128, I // 128)
        weights = E * 3 * I * H  # one byte each
        scales = E * 3 * (I // 128) * (H // 128) * 4
        assert sum(t.numel() * t.element_size() for t in tensors.values()) == weights + scales
        w13, w2 = block.expert_weights
        assert isinstance(w13, BlockFP8Weight) and w13.data is tensors["w13"] and w2.scales is tensors["w2_scale"]
        with pytest.raises(RuntimeError, match="already quantized"):
            block.experts.load_fused("down_proj", torch.zeros(E, H, I), "experts.down_proj")

    # The forward uses them as they are: nothing is quantized or cached on the way.
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    blocks[0](x)
    assert len(blocks[0].kernel.experts._weights) == 0


def test_fp8_expert_weights_give_the_outputs_of_the_lazy_path(deep_gemm):
    """The same random model (same seed) with the torch backend keeps its bf16 weights: the
    deep_gemm kernel fed those (quantizing them lazily, the previous path) gives bit for bit
    what the model's own fp8 weights give, and both are within fp8 error of the torch experts."""
    fp8_model = build_random_deepseek_v2_lite(MoEConfig(moe_backend="deep_gemm"), dtype=torch.bfloat16, overrides=SMALL)
    bf16_model = build_random_deepseek_v2_lite(MoEConfig(moe_backend="torch"), dtype=torch.bfloat16, overrides=SMALL)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for fp8_block, bf16_block in zip(_moe_blocks(fp8_model), _moe_blocks(bf16_model)):
        assert bf16_block.experts.w13.dtype == torch.bfloat16
        out = fp8_block(x)
        topk = fp8_block.select(fp8_block.router_logits(x))
        lazy = fp8_block.kernel(x, bf16_block.experts.w13, bf16_block.experts.w2, *topk)
        assert torch.equal(out, lazy)
        reference = bf16_block(x).float()
        assert float((out.float() - reference).norm() / reference.norm()) < FP8_REL_TOL


def test_the_loader_quantizes_a_checkpoints_expert_weights(deep_gemm, tmp_path):
    """`load_model` on a Hugging Face directory does what the built-in builders do: the
    deep_gemm experts hold fp8 weights once the checkpoint is read, equal to the builder's."""
    import json

    from safetensors.torch import save_file

    from tandem.models.loader import load_model
    from tandem.models.random_deepseek import DEEPSEEK_V2_LITE
    from tandem.models.tiny_moe import build_tokenizer

    source = build_random_deepseek_v2_lite(MoEConfig(moe_backend="torch"), dtype=torch.bfloat16, overrides=SMALL)
    renamed = {"experts.w13": "experts.gate_up_proj", "experts.w2": "experts.down_proj"}
    tensors = {}
    for name, tensor in source.model.state_dict().items():
        for ours, theirs in renamed.items():
            name = name.replace(ours, theirs)
        tensors[name] = tensor.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK_V2_LITE, **SMALL}))
    build_tokenizer().save(str(tmp_path / "tokenizer.json"))

    loaded = load_model(tmp_path, MoEConfig(moe_backend="deep_gemm"), dtype=torch.bfloat16)
    built = build_random_deepseek_v2_lite(MoEConfig(moe_backend="deep_gemm"), dtype=torch.bfloat16, overrides=SMALL)
    for ours, theirs in zip(_moe_blocks(loaded), _moe_blocks(built)):
        got, want = _expert_tensors(ours), _expert_tensors(theirs)
        assert {n: t.dtype for n, t in got.items()} == {n: t.dtype for n, t in want.items()}
        assert all(torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in ("w13", "w2"))
        assert all(torch.equal(got[n], want[n]) for n in ("w13_scale", "w2_scale"))
