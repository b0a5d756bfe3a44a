"""What a step's modules must move and compute at the least, from shapes alone: the bytes
of weights they read (only the experts the router picked), of activations in and out, of KV
cache read, and the matmul FLOPs. These are floors of the work, not of a kernel: attention
that gathers a whole block table, or a float32 copy of a bf16 weight, moves more, and the
profile shows it as a low share of the roofline."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable, Sequence

import torch
from torch import nn


@dataclass
class Cost:
    weight_bytes: float = 0.0
    activation_bytes: float = 0.0
    kv_bytes: float = 0.0
    flops: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.activation_bytes + self.kv_bytes

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class StepShape:
    """The step as the host scheduled it: per request, tokens new in this step and tokens
    already cached before it."""

    new_tokens: Sequence[int]
    cached_tokens: Sequence[int]

    @property
    def attention_pairs(self) -> int:
        """(query, key) pairs causal attention scores: query i of q new tokens after c cached
        ones sees c + i keys."""
        return sum(q * c + q * (q + 1) // 2 for q, c in zip(self.new_tokens, self.cached_tokens))

    @property
    def kv_tokens_read(self) -> int:
        return sum(q + c for q, c in zip(self.new_tokens, self.cached_tokens))


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in `obj` (a tensor, or tuples / lists / dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


def _state_bytes(module: nn.Module) -> int:
    return sum(tensor_bytes(t) for t in (*module.parameters(), *module.buffers()))


def _linear_weights(module: nn.Module, skip: Iterable[nn.Module] = ()) -> int:
    """Weight elements of the `nn.Linear`s in `module` outside `skip`: 2 x tokens x this
    many FLOPs when each token goes through each of them once."""
    skipped = {id(m) for s in skip for m in s.modules()}
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear) and id(m) not in skipped)


def is_moe_block(module: nn.Module) -> bool:
    return hasattr(module, "kernel") and hasattr(module, "experts") and hasattr(module, "top_k")


def experts_cost(block: nn.Module, tokens: int, experts_touched: int) -> Cost:
    """The routed experts of one MoE block: each picked expert's weights read once, top-k
    expert MLPs (gate, up, down) per token."""
    experts = block.experts
    per_expert = _state_bytes(experts) / max(len(experts.local), 1)
    hidden = block.gate.in_features
    return Cost(weight_bytes=per_expert * experts_touched, flops=2 * tokens * block.top_k * 3 * hidden * experts.intermediate_size)


def attention_core_flops(attn: nn.Module, shape: StepShape) -> float:
    """Scores and weighted values over the cached keys: 2 x pairs x heads x (d_qk + d_v)."""
    if hasattr(attn, "kv_cache_mode"):  # MLA
        c = attn.cfg
        if attn.kv_cache_mode == "latent":
            d_qk, d_v = c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank
        else:
            d_qk, d_v = c.qk_head_dim, c.v_head_dim
    else:
        d_qk = d_v = attn.head_dim
    return 2.0 * shape.attention_pairs * attn.num_heads * (d_qk + d_v)


def kv_read_bytes(attn: nn.Module, shape: StepShape) -> float:
    spec = attn.kv_cache_spec()
    per_token = sum(torch.Size(s).numel() for s in spec.shapes.values()) * torch.empty((), dtype=spec.dtype).element_size()
    return float(per_token * shape.kv_tokens_read)


def module_cost(module: nn.Module, tokens: int, shape: StepShape, experts_touched: dict[int, int]) -> Cost:
    """Weights, KV and FLOPs of one call of `module` on `tokens` tokens (activations are
    measured from the call itself). `experts_touched[id(block)]`: distinct experts the
    block's router picked this step."""
    if isinstance(module, nn.Embedding):
        return Cost(weight_bytes=tokens * module.embedding_dim * module.weight.element_size())
    if is_moe_block(module):
        rest = Cost(
            weight_bytes=_state_bytes(module) - _state_bytes(module.experts),
            flops=2 * tokens * _linear_weights(module, skip=[module.experts]),
        )
        return rest + experts_cost(module, tokens, experts_touched.get(id(module), len(module.experts.local)))
    cost = Cost(weight_bytes=_state_bytes(module), flops=2 * tokens * _linear_weights(module))
    if hasattr(module, "kv_cache_spec"):
        cost.flops += attention_core_flops(module, shape)
        cost.kv_bytes = kv_read_bytes(module, shape)
    return cost


def logits_cost(weight: torch.Tensor, rows: int) -> Cost:
    """The LM head: the whole vocabulary's weight read, `rows` hidden states projected."""
    return Cost(weight_bytes=tensor_bytes(weight), flops=2 * rows * weight.numel())


def distinct_experts(topk_ids: Sequence[torch.Tensor]) -> int:
    """Distinct expert ids (>= 0) over a layer's routing decisions this step. Reads device
    values: call it after the timed step, never inside one."""
    ids = torch.cat([t.flatten() for t in topk_ids])
    return int(torch.unique(ids[ids >= 0]).numel())


__all__ = [
    "Cost", "StepShape", "attention_core_flops", "distinct_experts", "experts_cost", "is_moe_block", "kv_read_bytes",
    "logits_cost", "module_cost", "tensor_bytes",
]
