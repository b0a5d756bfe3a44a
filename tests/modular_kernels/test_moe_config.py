"""`MoEConfig`: one object carries the MoE settings from `EngineConfig` to every layer's
kernel, each backend declares the options it reads, and a setting a backend would ignore is
refused when the config is made."""

from __future__ import annotations

from dataclasses import fields

import pytest

from tandem.config import EngineConfig, OverlapConfig, ParallelConfig
from tandem.modular_kernels import ALL2ALL_BACKENDS, FabricModel, MoEConfig
from tandem.modular_kernels.factory import DISPATCH_OPTIONS, prepare_class


def test_the_engine_config_hands_every_moe_setting_to_the_layers():
    """Every field of MoEConfig is set from the engine config: none is left at its default
    when the flags ask otherwise, so no setting is dropped on the way to the kernel."""
    group = object()
    config = EngineConfig(
        model="tiny-moe",
        max_num_batched_tokens=64,
        parallel=ParallelConfig(
            data_parallel_size=2,
            all2all_backend="deepep_low_latency",
            moe_backend="triton",
            use_fp8_dispatch=True,
            enable_sbo=True,
            sbo_mode="combine-shared",
            fabric="deepep-ll-h800",
            dispatch_max_tokens_per_rank=64,
        ),
        overlap=OverlapConfig(comm_sms=24),
    )
    moe = config.moe_config(group)
    assert moe == MoEConfig(
        all2all_backend="deepep_low_latency",
        moe_backend="triton",
        group=group,
        dispatch_max_tokens_per_rank=64,
        use_fp8_dispatch=True,
        enable_sbo=True,
        sbo_mode="combine-shared",
        fabric=FabricModel.from_flags(None, None, "deepep-ll-h800"),
        comm_sms=24,
    )
    defaults = MoEConfig()
    assert [f.name for f in fields(MoEConfig) if getattr(moe, f.name) == getattr(defaults, f.name)] == []


def test_the_engine_config_gives_the_backend_its_default_budget():
    config = EngineConfig(model="tiny-moe", max_num_batched_tokens=96,
                          parallel=ParallelConfig(data_parallel_size=2, all2all_backend="torch_a2a_ll"))
    assert config.moe_config().dispatch_max_tokens_per_rank == 96
    assert EngineConfig(model="tiny-moe").moe_config() == MoEConfig()


def test_fp8_dispatch_is_a_setting_every_backend_takes():
    # It used to be checked as a dispatch option, which no backend declares: any config with it failed.
    for backend in ("local", "torch_a2a", "torch_a2a_ll"):
        dp = 1 if backend == "local" else 2
        parallel = ParallelConfig(data_parallel_size=dp, all2all_backend=backend, use_fp8_dispatch=True)
        assert EngineConfig(model="tiny-moe", parallel=parallel).moe_config().use_fp8_dispatch


def test_each_dispatch_backend_declares_the_options_it_reads():
    assert DISPATCH_OPTIONS == {
        "local": frozenset(),
        "torch_a2a": {"fabric"},
        "torch_a2a_ll": {"dispatch_max_tokens_per_rank", "fabric"},
        "deepep_low_latency": {"dispatch_max_tokens_per_rank", "fabric", "comm_sms"},
        "deepep_high_throughput": {"fabric", "comm_sms"},
    }
    for name in ALL2ALL_BACKENDS:
        assert prepare_class(name).dispatch_options == DISPATCH_OPTIONS[name]
        assert prepare_class(name).name == name


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"all2all_backend": "nccl"}, r"unknown all2all backend 'nccl': expected one of \['deepep_high_throughput'"),
        ({"moe_backend": "cutlass"}, r"unknown moe backend 'cutlass': expected one of \['deep_gemm', 'torch', 'triton'\]"),
        ({"sbo_mode": "sideways"}, "sbo_mode must be one of"),
        ({"all2all_backend": "torch_a2a", "dispatch_max_tokens_per_rank": 16},
         r"dispatch_max_tokens_per_rank \(--dispatch-max-tokens-per-rank\) has no effect on the 'torch_a2a'"),
        ({"comm_sms": 24}, r"comm_sms \(--comm-sms\) has no effect on the 'local' all2all backend; "
                           "only deepep_low_latency, deepep_high_throughput use it"),
        ({"all2all_backend": "torch_a2a_ll", "dispatch_max_tokens_per_rank": 8, "comm_sms": 24}, "comm_sms"),
    ],
)
def test_a_config_a_backend_cannot_honour_is_refused_when_made(settings, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**settings)


def test_the_kernel_is_built_from_the_config():
    moe = MoEConfig(enable_sbo=True, sbo_mode="combine-shared")
    kernel = moe.build_kernel(num_experts=4, top_k=2, hidden_size=16, shared_experts=lambda x: x)
    assert kernel.prepare_finalize.name == "local" and kernel.experts.name == "torch"
    assert kernel.prepare_finalize.num_experts == 4
    assert kernel.enable_sbo and kernel.sbo_mode == "combine-shared"
    with pytest.raises(ValueError, match=r"top_k=5 must lie in \[1, num_experts=4\]"):
        moe.build_kernel(num_experts=4, top_k=5, hidden_size=16)
    with pytest.raises(ValueError, match="fp8 dispatch needs hidden_size divisible by 128, got 96"):
        MoEConfig(use_fp8_dispatch=True).build_kernel(num_experts=4, top_k=2, hidden_size=96)


def test_a_multi_rank_backend_needs_a_process_group():
    with pytest.raises(ValueError, match="all2all backend 'torch_a2a' needs an initialised torch.distributed process group"):
        MoEConfig(all2all_backend="torch_a2a").build_kernel(num_experts=4, top_k=2, hidden_size=16)
