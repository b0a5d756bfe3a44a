"""SBO `combine-down-gemm` in the simulator: where the runtime can run it, how many blocks it
cuts the down projection into, and what each block's steps cost.

The runtime (`FusedMoEModularKernel.compute_experts`) runs the experts' up projection once,
then the down projection block by block, and sends each finished block's combine on the comm
stream at once; the order comes from that method (`kernel_trace`), the costs from here:

- the up projection and activation (`EXPERTS_UP`): the experts as GEMMs less their down GEMM
  (blocks take torch's path, not the fused CPU kernel `OpCosts` prices a model's experts at);
- one block's down projection (`DOWN_BLOCK`): `OpCosts.down_projection` on the block's share of
  every local expert's rows, priced as the GEMM of those rows, not as a share of the whole;
- one block's combine (`COMBINE_BLOCK`, a send): the combine of the block's share of the
  tokens, so each block pays the transfer's fixed cost per call (what sending per block costs).

Only backends that send a combine per block can run the mode (`supports_block_combine`:
`torch_a2a`, `torch_a2a_ll`); the runtime refuses it on DeepEP's (`sbo.check_block_combine`,
run when the kernel's `sbo_mode` is set). A GPU profile prices DeepEP's kernels, so there the
simulator refuses it with the runtime's reason; a host whose cores move the transfers
(`--hardware here`, gloo's `torch_a2a`) plays it.
"""

from __future__ import annotations

from dataclasses import replace

from tandem.modular_kernels.interfaces import PrepareAndFinalize
from tandem.modular_kernels.sbo import COMBINE_DOWN_GEMM, check_block_combine
from tandem.simulate.kernel_trace import COMBINE_BLOCK, DOWN_BLOCK, EXPERTS_UP
from tandem.simulate.ops import OpCosts, UBatchWork

MODE = f"sbo-{COMBINE_DOWN_GEMM}"
#: The block steps priced here rather than by `OpCosts.compute`.
COMPUTE_STEPS = (EXPERTS_UP, DOWN_BLOCK)


def refuse_without_block_combine(backend: type[PrepareAndFinalize], hardware: str) -> None:
    """A ValueError, with the runtime's own reason, where `backend` (the transfers the profile
    prices) cannot send the combine per block: the runtime's check run on it (it reads only the
    class's `supports_block_combine` and `name`, so an instance needs no process group)."""
    try:
        check_block_combine(COMBINE_DOWN_GEMM, backend.__new__(backend))
    except ValueError as exc:
        raise ValueError(f"{MODE} cannot run on {hardware}, whose transfers are {backend.name}'s: {exc}") from None


def block_count(costs: OpCosts) -> int:
    """Blocks per MoE layer: one per local expert, the runtime's rule in both backends that can
    send per block (`finalize_in_blocks`: `torch_a2a` a chunk of every source rank's rows per
    local expert, `torch_a2a_ll` one local expert a block)."""
    return costs.local_experts()


def block_work(work: UBatchWork, blocks: int) -> UBatchWork:
    """One block's share of a ubatch's tokens (balanced routing: the blocks are equal)."""
    return replace(work, tokens=work.tokens / blocks)


def block_compute(costs: OpCosts, name: str, work: UBatchWork, blocks: int) -> float:
    """Seconds of a compute step of combine-down-gemm's experts (`COMPUTE_STEPS`)."""
    if name == EXPERTS_UP:
        # The runtime runs blocks on torch's path, never the fused CPU kernel (`TorchExperts.apply_blocks`).
        return costs.torch_path_experts(work) - costs.down_projection(work)
    if name == DOWN_BLOCK:
        return costs.down_projection(work, blocks)
    raise KeyError(f"{name!r} is not a step of combine-down-gemm's experts")


__all__ = ["COMBINE_BLOCK", "COMPUTE_STEPS", "MODE", "block_compute", "block_count", "block_work",
           "refuse_without_block_combine"]  # fmt: skip
