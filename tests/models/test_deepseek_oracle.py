"""DeepSeek-V2/V3 against transformers: prefill, greedy decode and mixed prefill+decode
batches over the paged cache give the logits HF gives on the full sequence."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from tandem.modular_kernels import MoEConfig  # noqa: E402
from tandem.models.deepseek import DeepseekConfig, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM  # noqa: E402
from tandem.testing.model_harness import GreedyHarness  # noqa: E402

TOL = 1e-4

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    initializer_range=0.05,
    rms_norm_eps=1e-6,
)

CASES = {
    # V2: full-rank queries, plain softmax top-k, two shared experts, every layer MoE.
    "v2_greedy": (
        2,
        dict(
            COMMON,
            vocab_size=128,
            num_hidden_layers=2,
            q_lora_rank=None,
            n_shared_experts=2,
            topk_method="greedy",
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            first_k_dense_replace=0,
        ),
    ),
    # V2: low-rank queries, group-limited greedy routing, biased projections, one dense layer.
    "v2_group_limited": (
        2,
        dict(
            COMMON,
            vocab_size=200,
            num_hidden_layers=3,
            q_lora_rank=32,
            n_shared_experts=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            first_k_dense_replace=1,
            attention_bias=True,
        ),
    ),
    # V3: sigmoid + correction bias + grouped top-k, one dense layer, plain rope.
    "v3_noaux": (
        3,
        dict(
            COMMON,
            vocab_size=256,
            num_hidden_layers=3,
            q_lora_rank=32,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
        ),
    ),
    # V3 with YaRN rope scaling (mscale != mscale_all_dim, so both factors matter).
    "v3_yarn": (
        3,
        dict(
            COMMON,
            vocab_size=160,
            num_hidden_layers=2,
            q_lora_rank=24,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.8,
                "mscale_all_dim": 1.0,
            },
        ),
    ),
    # V3 with rotate-half rope, tied embeddings, no q lora, no grouping.
    "v3_neox_tied": (
        3,
        dict(
            COMMON,
            vocab_size=144,
            num_hidden_layers=2,
            q_lora_rank=None,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            first_k_dense_replace=0,
            rope_interleave=False,
            tie_word_embeddings=True,
        ),
    ),
}


def _hf_classes(version: int):
    if version == 2:
        return transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, DeepseekV2ForCausalLM
    return transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, DeepseekV3ForCausalLM


def _build(name: str, tmp_path, kv_cache_mode: str = "latent", moe: MoEConfig | None = None):
    version, kwargs = CASES[name]
    config_cls, hf_cls, our_cls = _hf_classes(version)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    hf = hf_cls(config).eval()
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        # Make norms, biases and the routing correction bias non-trivial.
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for bname, b in hf.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    hf.save_pretrained(tmp_path)
    saved_config = json.loads((tmp_path / "config.json").read_text())
    ours = our_cls(saved_config, moe=moe, kv_cache_mode=kv_cache_mode)
    weights = load_file(str(tmp_path / "model.safetensors"))
    loaded = ours.load_weights(weights.items())
    return hf, ours, loaded, weights


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens]), use_cache=False).logits[0].float()


def _close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, diff
    return diff


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_and_greedy_decode_match_transformers(name, tmp_path):
    hf, ours, loaded, _ = _build(name, tmp_path)
    assert loaded == {n for n, _ in ours.named_parameters()}
    vocab = CASES[name][1]["vocab_size"]
    harness = GreedyHarness(ours, num_blocks=32, block_size=4)
    seq = {"tokens": _prompt(vocab, 7, seed=1), "computed": 0}
    logits = harness.step([seq])
    _close(logits, _hf_logits(hf, seq["tokens"]))
    for _ in range(5):
        seq["tokens"].append(int(logits[-1].argmax()))
        logits = harness.step([seq])
        assert logits.shape[0] == 1
        _close(logits[-1], _hf_logits(hf, seq["tokens"])[-1])


@pytest.mark.parametrize("name,mode", [("v2_group_limited", "latent"), ("v3_yarn", "latent"), ("v3_noaux", "expanded")])
def test_mixed_prefill_and_decode_batch(name, mode, tmp_path):
    hf, ours, _, _ = _build(name, tmp_path, kv_cache_mode=mode)
    vocab = CASES[name][1]["vocab_size"]
    harness = GreedyHarness(ours, num_blocks=32, block_size=4)
    a = {"tokens": _prompt(vocab, 6, seed=2), "computed": 0}
    b = {"tokens": _prompt(vocab, 9, seed=3), "computed": 0}
    first = harness.step([a])
    a["tokens"].append(int(first[-1].argmax()))
    # One step: a decodes one token while b prefills its whole prompt.
    mixed = harness.step([a, b])
    assert mixed.shape[0] == 1 + 9
    _close(mixed[0], _hf_logits(hf, a["tokens"])[-1])
    _close(mixed[1:], _hf_logits(hf, b["tokens"]))
    # Then both decode together, and a chunked prefill of a third prompt joins.
    c = {"tokens": _prompt(vocab, 5, seed=4), "computed": 0}
    a["tokens"].append(int(mixed[0].argmax()))
    b["tokens"].append(int(mixed[-1].argmax()))
    c_full = list(c["tokens"])
    c["tokens"] = c_full[:3]
    step = harness.step([a, b, c])
    c["tokens"] = c_full
    rest = harness.step([c])
    _close(step[0], _hf_logits(hf, a["tokens"])[-1])
    _close(step[1], _hf_logits(hf, b["tokens"])[-1])
    _close(torch.cat([step[2:], rest]), _hf_logits(hf, c_full))

    # The same requests run one at a time on a fresh cache agree with the batch.
    alone = GreedyHarness(ours, num_blocks=32, block_size=4)
    solo = alone.step([{"tokens": list(b["tokens"][:-1]), "computed": 0}])
    torch.testing.assert_close(solo, mixed[1:], atol=TOL, rtol=0)


def test_latent_and_expanded_caches_agree(tmp_path):
    _, latent, _, weights = _build("v3_noaux", tmp_path)
    expanded = DeepseekV3ForCausalLM(latent.config, kv_cache_mode="expanded")
    expanded.load_weights(weights.items())
    assert latent.kv_cache_specs()[0].shapes == {"kv_latent": (1, 16 + 8)}
    assert expanded.kv_cache_specs()[0].shapes == {"key": (4, 24), "value": (4, 12)}
    tokens = _prompt(256, 10, seed=5)
    out = [GreedyHarness(m, num_blocks=16, block_size=4).step([{"tokens": tokens, "computed": 0}]) for m in (latent, expanded)]
    torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=0)


def test_unknown_checkpoint_names_raise(tmp_path):
    _, ours, _, weights = _build("v2_greedy", tmp_path)
    bad = dict(weights)
    bad["model.layers.0.self_attn.q_a_proj.weight"] = torch.zeros(1)  # no q lora in this config
    bad["model.layers.9.mlp.gate.weight"] = torch.zeros(1)
    bad["model.rotary_emb.inv_freq"] = torch.zeros(4)  # HF buffer: ignored
    with pytest.raises(ValueError, match=r"q_a_proj.*layers\.9|layers\.9.*q_a_proj"):
        ours.load_weights(bad.items())
    wrong_shape = {"model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="model.norm.weight"):
        ours.load_weights(wrong_shape.items())


class _SecondHalf(MoEConfig):
    """Rank 1 of 2 for loading purposes (the kernel itself stays single-rank)."""

    def local_experts(self, num_experts: int) -> range:
        return range(num_experts // 2, num_experts)


def test_load_keeps_only_local_experts(tmp_path):
    _, ours, _, weights = _build("v3_noaux", tmp_path, moe=_SecondHalf())
    w1 = ours.model.layers[1].mlp.experts.w13
    w2 = ours.model.layers[1].mlp.experts.w2
    assert w1.shape == (4, 64, 64) and w2.shape == (4, 64, 32)
    for local, expert in enumerate(range(4, 8)):
        p = f"model.layers.1.mlp.experts.{expert}."
        torch.testing.assert_close(w1[local, :32], weights[p + "gate_proj.weight"])
        torch.testing.assert_close(w1[local, 32:], weights[p + "up_proj.weight"])
        torch.testing.assert_close(w2[local], weights[p + "down_proj.weight"])


def test_old_style_rope_config_matches_rope_parameters():
    base = dict(CASES["v3_yarn"][1])
    new_style = DeepseekConfig.from_hf(base, 3)
    old = {k: v for k, v in base.items() if k != "rope_parameters"}
    params = dict(base["rope_parameters"])
    old["rope_theta"] = params.pop("rope_theta")
    params.pop("rope_type")
    old["rope_scaling"] = {"type": "yarn", **params}
    assert DeepseekConfig.from_hf(old, 3).rope == new_style.rope
    assert new_style.rope.rope_type == "yarn" and new_style.rope.factor == 4.0
