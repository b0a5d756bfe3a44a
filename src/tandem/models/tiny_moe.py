"""`tiny-moe`: the built-in model, so every command runs with nothing downloaded.

A DeepSeek-V3-shaped model (MLA, one dense layer then MoE layers with grouped sigmoid
routing, a shared expert and 8 routed experts, so it shards over 1, 2, 4 or 8
expert-parallel ranks) with seeded random weights and a byte-level tokenizer (ids 0-255
are the bytes, then `<|bos|>`, `<|eos|>`). Its text is gibberish, but it is the same
gibberish on every machine and every rank layout: the weights are drawn once in HF
checkpoint form and each rank loads its experts from that, exactly as from a directory.
`save_tiny_moe(dir)` writes it as a Hugging Face model directory.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from tandem.models.base import ModelInfo
from tandem.modular_kernels import MoEConfig

SEED = 20261121
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
NUM_BYTES = 256
BOS_ID = NUM_BYTES
EOS_ID = NUM_BYTES + 1

CONFIG: dict = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 320,  # 256 bytes + 2 specials, padded to a multiple of 64
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_interleave": True,
    "attention_bias": False,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "torch_dtype": "float32",
}


def _hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by its DeepSeek hub name."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    heads, qk = cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    q_rank, kv_rank, rope = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_a_proj.weight": (q_rank, H),
                p + "self_attn.q_a_layernorm.weight": (q_rank,),
                p + "self_attn.q_b_proj.weight": (heads * qk, q_rank),
                p + "self_attn.kv_a_proj_with_mqa.weight": (kv_rank + rope, H),
                p + "self_attn.kv_a_layernorm.weight": (kv_rank,),
                p + "self_attn.kv_b_proj.weight": (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), kv_rank),
                p + "self_attn.o_proj.weight": (H, heads * cfg["v_head_dim"]),
            }
        )
        if i < cfg["first_k_dense_replace"]:
            mlps = {"mlp": cfg["intermediate_size"]}
        else:
            E, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (E, H)
            shapes[p + "mlp.gate.e_score_correction_bias"] = (E,)
            mlps = {f"mlp.experts.{e}": inter for e in range(E)}
            mlps["mlp.shared_experts"] = inter * cfg["n_shared_experts"]
        for name, inter in mlps.items():
            shapes[p + f"{name}.gate_proj.weight"] = (inter, H)
            shapes[p + f"{name}.up_proj.weight"] = (inter, H)
            shapes[p + f"{name}.down_proj.weight"] = (H, inter)
    shapes["model.norm.weight"] = (H,)
    shapes["lm_head.weight"] = (V, H)
    return shapes


@lru_cache(maxsize=1)
def tiny_moe_weights() -> dict[str, torch.Tensor]:
    """The checkpoint, drawn from one seeded generator in a fixed name order. Scales keep
    activations near unit size and the logits spread out, so greedy choices are not
    near-ties that float reassociation (a different batch split) could flip."""
    gen = torch.Generator().manual_seed(SEED)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in _hf_shapes(CONFIG).items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            tensor = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            tensor = 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            tensor = torch.randn(shape, generator=gen)
        elif name == "lm_head.weight":
            # Printable ASCII rows get the largest scale, so the gibberish is readable text.
            scale = torch.full((shape[0], 1), 0.5)
            scale[ord(" ") : ord("~") + 1] = 4.0
            tensor = scale * torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        else:
            tensor = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        weights[name] = tensor.contiguous()
    return weights


def _byte_to_unicode() -> dict[int, str]:
    """The byte → printable-character table of byte-level BPE (what `ByteLevel`
    pre-tokenization produces), so token id == byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(NUM_BYTES):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(NUM_BYTES + extra)
            extra += 1
    return table


def build_tokenizer():
    """A byte-level `tokenizers.Tokenizer`: every byte its own token, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _byte_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS_TOKEN, EOS_TOKEN])
    assert tokenizer.token_to_id(BOS_TOKEN) == BOS_ID and tokenizer.token_to_id(EOS_TOKEN) == EOS_ID
    return tokenizer


def build_tiny_moe(
    moe: MoEConfig | None = None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", stage=None
) -> ModelInfo:
    """The tiny-moe model for this expert-parallel rank (`moe` says which experts it holds)
    and pipeline stage (`stage`, a `StageLayers`: which layers; default all), its parameters
    allocated on `device`. The weights are drawn on the CPU from one seeded generator, so
    every device and rank layout gets the same model."""
    from tandem.models.deepseek import DeepseekV3ForCausalLM

    with torch.device(device):
        model = DeepseekV3ForCausalLM(dict(CONFIG), moe=moe, dtype=dtype, stage=stage)
    # Each rank reads its own experts (and its stage's layers) of the one checkpoint.
    selected = ((name, tensor) for name, tensor in tiny_moe_weights().items() if model.checkpoint_selection(name))
    model.load_weights(selected)
    model.prepare_weights_after_loading()
    model.eval()
    return byte_model_info(model, CONFIG["max_position_embeddings"], "tiny-moe")


def byte_model_info(model, max_model_len: int, name: str) -> ModelInfo:
    """A built-in model's `ModelInfo`: the byte tokenizer and its end-of-sequence token."""
    return ModelInfo(model=model, tokenizer=build_tokenizer(), eos_token_ids={EOS_ID}, max_model_len=max_model_len, name=name)


def save_tiny_moe(directory: str | Path) -> Path:
    """Write tiny-moe as a Hugging Face model directory (config, safetensors, tokenizer,
    generation config) that `load_model(directory)` reads back to the same model."""
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2), encoding="utf-8")
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}, indent=2), encoding="utf-8"
    )
    save_file(tiny_moe_weights(), str(path / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer().save(str(path / "tokenizer.json"))
    return path


__all__ = [
    "BOS_ID",
    "CONFIG",
    "EOS_ID",
    "build_tiny_moe",
    "build_tokenizer",
    "byte_model_info",
    "save_tiny_moe",
    "tiny_moe_weights",
]
