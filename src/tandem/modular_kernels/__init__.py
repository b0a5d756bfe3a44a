"""FusedMoEModularKernel = PrepareAndFinalize (dispatch/combine backends) + Experts
(grouped-GEMM backends) + routing; DBO yield points and SBO."""

from tandem.modular_kernels.experts_torch import TorchBatchedExperts, TorchExperts
from tandem.modular_kernels.fabric import FabricModel
from tandem.modular_kernels.factory import ALL2ALL_BACKENDS, MOE_BACKENDS
from tandem.modular_kernels.interfaces import ActivationFormat, BlockCombine, Experts, ExpertTokens, PrepareAndFinalize
from tandem.modular_kernels.kernel import FusedMoEModularKernel, MoEStepState
from tandem.modular_kernels.moe_config import MoEConfig, build_moe_kernel
from tandem.modular_kernels.prepare_local import LocalPrepareAndFinalize
from tandem.modular_kernels.quant import BlockFP8Weight, dequantize_fp8, quantize_fp8_per_token_group
from tandem.modular_kernels.sbo import SBO_MODES
from tandem.modular_kernels.routing import expert_mlp, select_experts, torch_moe_reference
from tandem.modular_kernels.sm_partition import comm_sm_partition

__all__ = [
    "ALL2ALL_BACKENDS",
    "ActivationFormat",
    "BlockCombine",
    "ExpertTokens",
    "Experts",
    "FabricModel",
    "FusedMoEModularKernel",
    "LocalPrepareAndFinalize",
    "MOE_BACKENDS",
    "MoEConfig",
    "MoEStepState",
    "PrepareAndFinalize",
    "SBO_MODES",
    "TorchBatchedExperts",
    "TorchExperts",
    "build_moe_kernel",
    "comm_sm_partition",
    "BlockFP8Weight",
    "dequantize_fp8",
    "expert_mlp",
    "quantize_fp8_per_token_group",
    "select_experts",
    "torch_moe_reference",
]
