"""Building blocks shared by the model families: GQA attention over the paged KV
cache, the gated MLP, the stacked experts and the MoE block that drives a modular kernel
(RMSNorm: `norm.py`; rotary embedding: `rope.py`; DeepSeek's latent attention: `mla.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.contexts import get_forward_context
from tandem.models.base import KVCacheSpec
from tandem.modular_kernels import MoEConfig
from tandem.models.norm import RMSNorm
from tandem.models.paged_attention import AttentionMetadata, paged_attention
from tandem.models.rope import RopeConfig, RotaryEmbedding
from tandem.modular_kernels import BlockFP8Weight, select_experts
from tandem.modular_kernels.activation import silu_and_mul
from tandem.models.linear import Linear
from tandem.platform.cpu_gemm import joined_linear
from tandem.models import opaque_ops  # noqa: F401  (registers torch.ops.tandem.*)


def opaque_attend(attention: nn.Module, prepared: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`attention.attend(prepared)`, through the `tandem::attention` custom op once the
    compiled step registered the layer (`tandem.models.opaque_ops`)."""
    name = getattr(attention, "opaque_op_name", None)
    return attention.attend(prepared) if name is None else torch.ops.tandem.attention(list(prepared), name)


def current_attention_metadata() -> AttentionMetadata:
    context = get_forward_context()
    if context is None or context.attn_metadata is None:
        raise RuntimeError(
            "attention needs AttentionMetadata in the forward context: run the model inside "
            "tandem.contexts.set_forward_context(ForwardContext(attn_metadata=...))"
        )
    return context.attn_metadata


class Attention(nn.Module):
    """Grouped-query attention with q/k/v/o projections that writes this step's K/V into its
    paged cache and attends over it. Options cover the families: `qkv_bias` (Qwen2-MoE),
    `o_bias` and per-head `qk_norm_eps` (Qwen3-MoE)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rope: RopeConfig,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        rotary: RotaryEmbedding | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} attention heads do not group over {num_kv_heads} KV heads")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.dtype = dtype
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=qkv_bias, dtype=dtype)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias, dtype=dtype)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias, dtype=dtype)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=o_bias, dtype=dtype)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary if rotary is not None else RotaryEmbedding(head_dim, rope)
        self.kv_cache: dict[str, torch.Tensor] | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        shape = (self.num_kv_heads, self.head_dim)
        return KVCacheSpec({"key": shape, "value": shape}, self.dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.core(self.prepare(positions, x))

    def prepare(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Projections (one GEMM over q, k and v joined where the CPU packs weights) and QK
        norm: `(positions, q, k, v)` (TBO's attention prepare)."""
        num_tokens = x.shape[0]
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if all(type(p) is Linear for p in projections):
            q, k, v = joined_linear(x, tuple(p.weight for p in projections), tuple(p.bias for p in projections))
        else:  # a projection with a forward of its own
            q, k, v = (p(x) for p in projections)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return positions, q, k, v

    def core(self, prepared: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """`attend`, then the output projection (TBO's attention core)."""
        return self.o_proj(opaque_attend(self, prepared))

    @property
    def attend_width(self) -> int:
        return self.num_heads * self.head_dim

    def attend(self, prepared: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Rotary embedding with the cache write (one kernel on CUDA) and attention over the
        cache: `[T, heads * head_dim]` (the compiled step's opaque `tandem::attention`)."""
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound: call model.bind_kv_cache(...) before the forward")
        positions, q, k, v = prepared
        metadata = current_attention_metadata()
        cache = self.kv_cache
        q = self.rotary.rotate_and_cache(positions, q, k, metadata.slot_mapping, cache["key"], copy=(v, cache["value"]))
        out = paged_attention(q, cache["key"], cache["value"], metadata, self.scale)
        return out.reshape(q.shape[0], self.attend_width)


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`, gate and up fused into one `gate_up_proj [2I, H]` (one
    GEMM); the loader fills its halves from HF's `gate_proj` / `up_proj`."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class StackedExperts(nn.Module):
    """This rank's routed experts as the kernel takes them: `w13 [E_local, 2I, H]` (gate rows,
    then up rows) and `w2 [E_local, H, I]`.

    Fills from per-expert checkpoint tensors (`experts.{e}.{proj}.weight`, with the family's
    projection names for gate / up / down) or from fused 3-D ones (`experts.gate_up_proj
    [E, 2I, H]`, `experts.down_proj [E, H, I]`, either all E experts or already this rank's
    rows). Experts outside `local` are skipped.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        local: range,
        *,
        proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.num_experts, self.local, self.intermediate_size = num_experts, local, intermediate_size
        self.roles = dict(zip(proj_names, ("gate", "up", "down")))
        n = len(local)
        self.w13 = nn.Parameter(torch.empty(n, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, hidden_size, intermediate_size, dtype=dtype), requires_grad=False)
        self._filled: dict[str, set[int]] = {"gate": set(), "up": set(), "down": set()}
        #: True once `hold` replaced the model-dtype weights with block-fp8 ones.
        self.quantized = False

    def hold(self, w13: torch.Tensor | BlockFP8Weight, w2: torch.Tensor | BlockFP8Weight) -> None:
        """Keep the weights the kernel's experts prepared instead of the loaded ones. Block-fp8
        weights become buffers `w13`/`w2` (fp8) and `w13_scale`/`w2_scale` (float32), and the
        model-dtype parameters are dropped (freed once nothing else holds them)."""
        if not isinstance(w13, BlockFP8Weight) and not isinstance(w2, BlockFP8Weight):
            return  # the experts read the loaded weights as they are
        for name, weight in (("w13", w13), ("w2", w2)):
            if not isinstance(weight, BlockFP8Weight):
                raise TypeError(f"{name}: the experts prepared one weight in block fp8 and not the other")
            delattr(self, name)
            self.register_buffer(name, weight.data)
            self.register_buffer(f"{name}_scale", weight.scales)
        self.quantized = True

    def kernel_weights(self) -> tuple:
        """`(w13, w2)` as the kernel takes them: the loaded tensors, or block-fp8 weights."""
        if self.quantized:
            return BlockFP8Weight(self.w13, self.w13_scale), BlockFP8Weight(self.w2, self.w2_scale)
        return self.w13, self.w2

    def _check_loadable(self, name: str) -> None:
        if self.quantized:
            raise RuntimeError(
                f"{name!r}: the experts' weights were already quantized to fp8 for the kernel (after loading); "
                "load every checkpoint tensor before the model is prepared"
            )

    def is_local(self, expert: int) -> bool:
        return expert in self.local

    def _rows(self, role: str, local_index: int) -> torch.Tensor:
        size = self.intermediate_size
        if role == "gate":
            return self.w13.detach()[local_index, :size]
        if role == "up":
            return self.w13.detach()[local_index, size:]
        return self.w2.detach()[local_index]

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
        dst.copy_(src)

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor, name: str) -> None:
        self._check_loadable(name)
        if proj not in self.roles:
            raise KeyError(f"unknown expert projection {proj!r} in {name!r}: expected one of {sorted(self.roles)}")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"{name!r}: expert {expert} is out of range for {self.num_experts} experts")
        if expert not in self.local:
            return
        role = self.roles[proj]
        index = expert - self.local.start
        self._copy(self._rows(role, index), tensor, name)
        self._filled[role].add(index)

    def local_rows(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """A fused tensor's rows for this rank: all `E` experts are sliced, `E_local` are kept."""
        if tensor.shape[0] == self.num_experts:
            return tensor[self.local.start : self.local.stop]
        if tensor.shape[0] == len(self.local):
            return tensor
        raise ValueError(
            f"{name!r}: fused expert tensor has {tensor.shape[0]} rows, expected {self.num_experts} "
            f"(all experts) or {len(self.local)} (this rank's)"
        )

    def load_fused(self, kind: str, tensor: torch.Tensor, name: str) -> None:
        self._check_loadable(name)
        rows = self.local_rows(tensor, name)
        everyone = range(len(self.local))
        if kind == "gate_up_proj":
            self._copy(self.w13.detach(), rows, name)
            self._filled["gate"].update(everyone)
            self._filled["up"].update(everyone)
        elif kind == "down_proj":
            self._copy(self.w2.detach(), rows, name)
            self._filled["down"].update(everyone)
        else:
            raise KeyError(f"unknown fused expert tensor {name!r}: expected gate_up_proj or down_proj")

    def loaded_parameters(self) -> list[str]:
        """`w13` / `w2` once every local expert has all of its pieces."""
        n = len(self.local)
        done = []
        if len(self._filled["gate"]) == n and len(self._filled["up"]) == n:
            done.append("w13")
        if len(self._filled["down"]) == n:
            done.append("w2")
        return done


class MoEBlock(nn.Module):
    """Router (`gate`, a bias-free linear to expert logits) + top-k selection + this rank's
    stacked experts, computed by a `FusedMoEModularKernel`. A subclass with shared experts
    passes `with_shared_experts=True` and overrides `shared_experts_forward`; the kernel
    calls it (so SBO/DBO can overlap it with communication) and adds its output.

    Routing options beyond softmax top-k (DeepSeek): `scoring="sigmoid"`, grouped top-k
    (`num_expert_group`, `topk_group`), a score-correction bias (`gate.e_score_correction_bias`,
    float32), `routed_scaling_factor`, and router logits computed in float32."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool,
        moe: MoEConfig | None = None,
        proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        with_shared_experts: bool = False,
        scoring: str = "softmax",
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        correction_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        float32_router: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        moe = moe or MoEConfig()
        self.top_k, self.renormalize = top_k, renormalize
        self.scoring, self.num_expert_group, self.topk_group = scoring, num_expert_group, topk_group
        self.routed_scaling_factor, self.float32_router = routed_scaling_factor, float32_router
        self.gate = Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        if correction_bias:
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))
        self.experts = StackedExperts(
            num_experts, hidden_size, intermediate_size, moe.local_experts(num_experts), proj_names=proj_names, dtype=dtype
        )
        self.kernel = moe.build_kernel(
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=hidden_size,
            shared_experts=self.shared_experts_forward if with_shared_experts else None,
        )

    def shared_experts_forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no shared experts")

    def prepare_loaded_weights(self) -> None:
        """Once the weights are loaded: let the kernel's experts put them in the form they
        compute with (deep_gemm: block fp8), freeing the loaded ones."""
        if not self.experts.quantized:
            self.experts.hold(*self.kernel.experts.prepare_weights(self.experts.w13, self.experts.w2))

    @property
    def expert_weights(self) -> tuple:
        return self.experts.kernel_weights()

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_router:
            if x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16):
                # One GEMM of the model-dtype operands with float32 accumulation and output:
                # the same products as upcasting both first, without the two casts.
                return torch.mm(x.reshape(-1, x.shape[-1]), self.gate.weight.t(), out_dtype=torch.float32)
            # `.float()` may make a copy per call: nothing to pack once.
            return F.linear(x.float(), self.gate.weight.float())
        return self.gate(x)

    def select(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(
            router_logits,
            self.top_k,
            renormalize=self.renormalize,
            scoring=self.scoring,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            correction_bias=getattr(self.gate, "e_score_correction_bias", None),
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = getattr(self, "opaque_op_name", None)
        return self.moe_forward(x) if name is None else torch.ops.tandem.moe(x, name)

    def moe_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Router, top-k and the kernel (the compiled step's opaque `tandem::moe`)."""
        return self.kernel(x, *self.expert_weights, *self.select(self.router_logits(x)))
