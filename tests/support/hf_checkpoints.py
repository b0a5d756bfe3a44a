"""Tiny random Hugging Face checkpoints (built with transformers) for the model oracle and
loader tests: configs, a byte-level tokenizer.json, and writers for the layouts on disk."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

VOCAB = 260  # 256 byte tokens + <|endoftext|> + spare rows
EOS = 256

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.15,
    eos_token_id=EOS,
)

#: family → (config class name, model class name, config overrides)
FAMILIES = {
    # Shared expert + sigmoid gate; layer 0 is dense (mlp_only_layers), no top-k renormalisation.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[0],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    # q_norm / k_norm, renormalised top-k, tied embeddings, head_dim != hidden / heads.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    ),
}


def build_hf_model(family: str, seed: int = 0):
    import transformers

    config_cls, model_cls, overrides = FAMILIES[family]
    config = getattr(transformers, config_cls)(**COMMON, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    return model


def _byte_symbols() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte, so token id == byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    symbols = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in symbols)
    symbols.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return symbols


def write_tokenizer(directory: Path) -> None:
    """A byte-level BPE without merges: one token per byte, plus `<|endoftext|>` as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    assert set(_byte_symbols().values()) == set(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: b for b, ch in _byte_symbols().items()}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    assert tokenizer.token_to_id("<|endoftext|>") == EOS
    tokenizer.save(str(directory / "tokenizer.json"))


def save_checkpoint(model, directory: Path) -> Path:
    """`save_pretrained` (per-expert tensor names on disk) plus tokenizer.json."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def save_fused_checkpoint(model, directory: Path) -> Path:
    """The in-memory transformers 5 layout on disk: fused 3-D `experts.gate_up_proj` /
    `experts.down_proj` and (Mixtral) `mlp.` instead of `block_sparse_moe.`."""
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"))
    write_tokenizer(directory)
    return directory


def shard_checkpoint(directory: Path, num_shards: int = 2) -> list[str]:
    """Split `model.safetensors` into shards + `model.safetensors.index.json`; returns shard names."""
    single = directory / "model.safetensors"
    with safe_open(str(single), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    single.unlink()
    names = sorted(tensors)
    shard_names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map = {}
    for i, shard in enumerate(shard_names):
        part = names[i::num_shards]
        save_file({n: tensors[n] for n in part}, str(directory / shard))
        weight_map.update({n: shard for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return shard_names


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of every position of `tokens` from a full (uncached) HF forward."""
    return model(torch.tensor([tokens])).logits[0].float()
