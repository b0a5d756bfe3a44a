"""The shape of a model as the simulator costs it, read the way the runtime reads it.

DeepSeek-V2/V3 configs go through `DeepseekConfig.from_hf` (the runtime's MLA and layer plan:
`is_moe_layer`), Qwen-MoE through its family's `is_sparse_layer`, Mixtral (every layer MoE)
through `config_value`. A model is a built-in name (the runtime's `tiny-moe`, `small-moe`,
`deepseek-v2-lite-random`, plus `deepseek-v3` here: DeepSeek-V3's published shape, no
weights), a `config.json` file or a model directory holding one; and `moe-stack`, the synthetic
stack `tandem bench --model moe-stack` runs (`tandem.bench.moe_stack.STACK_SHAPE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tandem.bench.moe_stack import MOE_STACK, STACK_SHAPE
from tandem.models.hf_config import HFConfig, config_value

#: DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3 on Hugging Face), the fields
#: the runtime reads: 61 layers, the first 3 dense, MLA, 256 routed experts + 1 shared, top-8.
DEEPSEEK_V3: dict = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0,
    },
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

PRESETS: dict[str, dict] = {"deepseek-v3": DEEPSEEK_V3}


@dataclass(frozen=True)
class ModelShape:
    """What the op model needs of a model: sizes, attention kind, which layers are MoE."""

    name: str
    attention: str  # "mla" or "gqa"
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    q_lora: int | None
    kv_lora: int
    nope: int
    rope: int
    v_dim: int
    intermediate: int
    moe_intermediate: int
    experts: int
    top_k: int
    topk_group: int | None
    shared_intermediate: int
    vocab: int
    sparse_layers: tuple[bool, ...]

    @property
    def num_layers(self) -> int:
        return len(self.sparse_layers)


def moe_stack_shape() -> ModelShape:
    """The bench's MoE stack (`MoEStack`): its attention stand-in is two hidden x hidden GEMMs
    (one "head" whose projections are those GEMMs, no KV cache), every layer MoE with one
    shared expert as wide as a routed one, no lm_head."""
    h, inter = STACK_SHAPE["hidden"], STACK_SHAPE["intermediate"]
    return ModelShape(
        name=MOE_STACK, attention="gqa", hidden=h, heads=1, kv_heads=0, head_dim=h, q_lora=None, kv_lora=0,
        nope=h, rope=0, v_dim=h, intermediate=inter, moe_intermediate=inter, experts=STACK_SHAPE["experts"],
        top_k=STACK_SHAPE["top_k"], topk_group=None, shared_intermediate=inter, vocab=0,
        sparse_layers=(True,) * STACK_SHAPE["layers"],
    )  # fmt: skip


def read_model_config(model: str) -> tuple[str, HFConfig]:
    """(name, config) of a preset, a built-in model of the runtime, a config.json or a model directory."""
    if model in PRESETS:
        return model, HFConfig(PRESETS[model])
    from tandem.models.loader import BUILTIN_MODELS, _builtin_config

    if model in BUILTIN_MODELS:
        return model, HFConfig(_builtin_config(model))
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        names = ", ".join(sorted({*PRESETS, *BUILTIN_MODELS}))
        raise FileNotFoundError(f"model {model!r} is not a preset ({names}), a config.json or a directory holding one")
    return path.parent.name if path.name == "config.json" else path.stem, HFConfig.from_file(path)


def _deepseek(name: str, config: HFConfig, version: int) -> ModelShape:
    from tandem.models.deepseek_config import DeepseekConfig

    cfg = DeepseekConfig.from_hf(config, version)
    return ModelShape(
        name=name, attention="mla", hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
        kv_heads=cfg.num_attention_heads, head_dim=cfg.qk_head_dim, q_lora=cfg.q_lora_rank,
        kv_lora=cfg.kv_lora_rank, nope=cfg.qk_nope_head_dim, rope=cfg.qk_rope_head_dim, v_dim=cfg.v_head_dim,
        intermediate=cfg.intermediate_size, moe_intermediate=cfg.moe_intermediate_size,
        experts=int(cfg.n_routed_experts or 0), top_k=cfg.num_experts_per_tok,
        topk_group=cfg.topk_group if cfg.grouped_routing else None,
        shared_intermediate=cfg.n_shared_experts * cfg.moe_intermediate_size,
        vocab=int(config_value(config, "vocab_size")),
        sparse_layers=tuple(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)),
    )  # fmt: skip


def _gqa_sparse_layers(model_type: str, config: HFConfig, layers: int) -> tuple[bool, ...]:
    if model_type == "mixtral":
        return (True,) * layers
    from tandem.models.qwen_moe import Qwen2MoeForCausalLM

    # The family's own rule, on a stand-in that has only what the rule reads.
    stand_in = SimpleNamespace(config=config)
    stand_in.num_experts = lambda: Qwen2MoeForCausalLM.num_experts(stand_in)
    return tuple(Qwen2MoeForCausalLM.is_sparse_layer(stand_in, i) for i in range(layers))


def _gqa(name: str, config: HFConfig, model_type: str) -> ModelShape:
    heads = int(config_value(config, "num_attention_heads"))
    hidden = int(config_value(config, "hidden_size"))
    layers = int(config_value(config, "num_hidden_layers"))
    head_dim = int(config_value(config, "head_dim", default=hidden // heads))
    moe_inter = int(config_value(config, "moe_intermediate_size", "intermediate_size"))
    return ModelShape(
        name=name, attention="gqa", hidden=hidden, heads=heads,
        kv_heads=int(config_value(config, "num_key_value_heads", default=heads)), head_dim=head_dim,
        q_lora=None, kv_lora=0, nope=head_dim, rope=0, v_dim=head_dim,
        intermediate=int(config_value(config, "intermediate_size")), moe_intermediate=moe_inter,
        experts=int(config_value(config, "num_experts", "num_local_experts")),
        top_k=int(config_value(config, "num_experts_per_tok")), topk_group=None,
        shared_intermediate=int(config_value(config, "shared_expert_intermediate_size", default=0)),
        vocab=int(config_value(config, "vocab_size")),
        sparse_layers=_gqa_sparse_layers(model_type, config, layers),
    )  # fmt: skip


def model_shape(model: str | dict | Any) -> ModelShape:
    """The shape of `model`: a preset or built-in name, a config.json path or directory, or a config dict."""
    if model == MOE_STACK:
        return moe_stack_shape()
    if isinstance(model, dict):
        name, config = str(model.get("_name_or_path", model.get("model_type", "model"))), HFConfig(model)
    else:
        name, config = read_model_config(str(model))
    model_type = str(config_value(config, "model_type", default=""))
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return _deepseek(name, config, 2 if model_type == "deepseek_v2" else 3)
    if model_type in ("qwen2_moe", "qwen3_moe", "mixtral"):
        return _gqa(name, config, model_type)
    raise ValueError(f"model_type {model_type!r} is not simulated; supported: deepseek_v2, deepseek_v3, qwen2_moe, qwen3_moe, mixtral")


__all__ = ["DEEPSEEK_V3", "PRESETS", "ModelShape", "model_shape", "moe_stack_shape", "read_model_config"]
