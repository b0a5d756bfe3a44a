"""One configuration: every setting is a field declared once in tandem.config, the command
line is generated from the fields, one dispatch budget, and --max-model-len enforced by the
ranks as well as the front end."""

from __future__ import annotations

from dataclasses import replace

import pytest
import typer
from typer.testing import CliRunner

from tandem.cli import app
from tandem.cli_options import ENGINE_SECTIONS, SECTIONS, config_flags, markdown_table
from tandem.config import EngineConfig, ParallelConfig, SchedulerConfig, cli_fields


def _click_params(command: str) -> dict:
    group = typer.main.get_command(app)
    return {p.name: p for p in group.commands[command].params}


def test_every_flag_is_generated_from_its_field_with_the_fields_default():
    params = _click_params("serve")
    for flag in config_flags(*ENGINE_SECTIONS, "http"):
        assert flag.param in params, flag.param
        if flag.param == "model":
            # serve takes MODEL or --model (as vllm serve does): neither has a default of its
            # own, so that giving both can be checked; the field's default applies.
            assert params["model"].default is None and params["model_option"].default is None
            continue
        assert params[flag.param].default == flag.default, flag.param
        assert params[flag.param].help == flag.meta["help"], flag.param
    # generate takes every engine section (not the HTTP one).
    generate = _click_params("generate")
    assert {f.param for f in config_flags(*ENGINE_SECTIONS)} <= generate.keys()
    assert "port" not in generate and "api_key" not in generate


def test_every_cli_field_has_help_and_one_parameter_name():
    seen = set()
    for section, (cls, _) in SECTIONS.items():
        for f in cli_fields(cls):
            assert f.metadata["cli"]["help"], f"{cls.__name__}.{f.name} has no help"
    for flag in config_flags(*SECTIONS):
        assert flag.param not in seen
        seen.add(flag.param)


def test_a_default_lives_in_one_place():
    # The engine and the scheduler take their defaults from the config tree.
    import inspect

    from tandem.engine.core import Engine
    from tandem.engine.scheduler import Scheduler

    from tandem.worker.future_map import FutureMap
    from tandem.worker.kv_cache import BlockAllocator

    scheduler = inspect.signature(Scheduler.__init__).parameters
    # The scheduler takes its section of the tree (unset: the tree's), not its fields one by one.
    assert scheduler["config"].default is None and "max_num_seqs" not in scheduler
    assert Scheduler(BlockAllocator(4), 4, FutureMap(4)).max_num_seqs == SchedulerConfig().max_num_seqs
    assert scheduler["max_num_batched_tokens"].default == EngineConfig().max_num_batched_tokens
    # The engine takes the scheduler section itself (max_num_seqs, step_timeout_s, ...): unset, the tree's.
    engine = inspect.signature(Engine.__init__).parameters
    assert all(engine[name].default is None for name in ("scheduler", "max_num_batched_tokens"))


def test_serve_flags_reach_the_config_tree(monkeypatch):
    import tandem.serving.server as server

    seen = {}
    monkeypatch.setattr(server, "run_server", lambda config, options, http: seen.update(config=config, http=http))
    args = [
        "serve", "--port", "0", "--max-num-seqs", "7", "--max-model-len", "100", "--disable-overlap-schedule",
        "--step-timeout", "5", "--kv-cache-tokens", "64", "--block-size", "4", "--max-num-batched-tokens", "96",
        "--pp-layer-partition", "3", "--api-key", "k", "--max-request-bytes", "77",
    ]
    cli = CliRunner().invoke(app, args)
    assert cli.exit_code == 0, cli.output
    config, http = seen["config"], seen["http"]
    assert (config.scheduler.max_num_seqs, config.scheduler.max_model_len) == (7, 100)
    assert (config.scheduler.overlap_schedule, config.scheduler.step_timeout_s) == (False, 5.0)
    assert (config.cache.num_kv_blocks, config.cache.block_size) == (64 // 4 + 1, 4)
    assert config.max_num_batched_tokens == 96 and config.parallel.pp_layer_partition == (3,)
    assert (http.port, http.api_key, http.max_request_bytes) == (0, "k", 77)


@pytest.mark.parametrize(
    "args, named",
    [
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-model-len", "1"], "--max-model-len"),
        (["--step-timeout", "0"], "--step-timeout"),
        (["--kv-cache-tokens", "8", "--block-size", "16"], "--kv-cache-tokens"),
        (["--max-request-bytes", "0"], "--max-request-bytes"),
        (["--pp-layer-partition", "a,b"], "comma-separated"),
        (["--all2all-backend", "torch_a2a", "--dispatch-max-tokens-per-rank", "64"], "dispatch_max_tokens_per_rank"),
        (["--all2all-backend", "torch_a2a", "--comm-sms", "24"], "comm_sms"),
    ],
)
def test_a_bad_flag_is_an_error_naming_it(monkeypatch, args, named):
    import tandem.serving.server as server

    monkeypatch.setattr(server, "run_server", lambda *a: pytest.fail("a bad flag must not start the server"))
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--data-parallel-size", "2", *args], terminal_width=300)
    assert result.exit_code != 0
    assert named in " ".join(result.output.split()), result.output


def test_old_deepep_budget_flag_is_an_alias_of_the_one_dispatch_budget(monkeypatch):
    import tandem.serving.server as server

    seen = {}
    monkeypatch.setattr(server, "run_server", lambda config, options, http: seen.setdefault("config", config))
    common = ["serve", "--port", "0", "--data-parallel-size", "2", "--all2all-backend", "torch_a2a_ll"]
    assert CliRunner().invoke(app, [*common, "--deepep-ll-max-tokens-per-rank", "48"]).exit_code == 0
    assert seen.pop("config").dispatch_max_tokens_per_rank == 48
    assert CliRunner().invoke(app, [*common, "--dispatch-max-tokens-per-rank", "40"]).exit_code == 0
    assert seen.pop("config").dispatch_max_tokens_per_rank == 40
    assert CliRunner().invoke(app, common).exit_code == 0
    # torch_a2a_ll's default budget: a whole step's tokens (it can never overflow).
    assert seen.pop("config").dispatch_max_tokens_per_rank == EngineConfig().max_num_batched_tokens
    assert "--deepep-ll-max-tokens-per-rank" not in CliRunner().invoke(app, ["serve", "--help"]).output


def test_the_deprecated_budget_name_is_resolved_by_one_rule_for_flags_and_the_factory():
    from tandem.modular_kernels import build_moe_kernel

    LL = "torch_a2a_ll"
    assert ParallelConfig(2, all2all_backend=LL, deepep_ll_max_tokens_per_rank=32, dispatch_max_tokens_per_rank=32)\
        .dispatch_max_tokens_per_rank == 32
    with pytest.raises(ValueError, match="old name of dispatch_max_tokens_per_rank"):
        ParallelConfig(2, all2all_backend=LL, deepep_ll_max_tokens_per_rank=32, dispatch_max_tokens_per_rank=16)
    with pytest.raises(ValueError, match="old name of dispatch_max_tokens_per_rank"):
        build_moe_kernel("local", "torch", num_experts=4, top_k=2, hidden_size=8,
                         dispatch_max_tokens_per_rank=16, deepep_ll_max_tokens_per_rank=32)


def test_dispatch_budget_defaults_per_backend():
    assert ParallelConfig(data_parallel_size=2, all2all_backend="torch_a2a_ll").dispatch_budget(512) == 512
    assert ParallelConfig(data_parallel_size=2, all2all_backend="deepep_low_latency").dispatch_budget(512) == 128
    assert ParallelConfig(data_parallel_size=2, all2all_backend="torch_a2a").dispatch_budget(512) is None
    assert ParallelConfig().dispatch_budget(512) is None


@pytest.mark.parametrize(
    "backend, option, named",
    [
        ("torch_a2a", {"dispatch_max_tokens_per_rank": 2048}, "dispatch_max_tokens_per_rank"),
        ("deepep_high_throughput", {"dispatch_max_tokens_per_rank": 128}, "dispatch_max_tokens_per_rank"),
        ("local", {"dispatch_max_tokens_per_rank": 16}, "dispatch_max_tokens_per_rank"),
        ("torch_a2a", {"comm_sms": 24}, "comm_sms"),
        ("torch_a2a_ll", {"comm_sms": 24, "dispatch_max_tokens_per_rank": 16}, "comm_sms"),
        ("local", {"fabric": object()}, "fabric"),
    ],
)
def test_factory_refuses_an_option_the_backend_would_ignore(backend, option, named):
    from tandem.modular_kernels import build_moe_kernel

    with pytest.raises(ValueError, match=f"{named}.*'{backend}'"):
        build_moe_kernel(backend, "torch", num_experts=4, top_k=2, hidden_size=16, **option)


def test_every_backend_declares_its_options():
    from tandem.modular_kernels.factory import ALL2ALL_BACKENDS, DISPATCH_OPTIONS

    assert DISPATCH_OPTIONS.keys() == ALL2ALL_BACKENDS.keys()


def test_the_ranks_enforce_max_model_len():
    from tandem.config import OverlapConfig
    from tandem.models.tiny_moe import build_tiny_moe
    from tandem.engine.build import build_engine
    from tandem.engine.core import Engine
    from tandem.worker.model_runner import ModelRunner
    from tandem.worker.sampling import SamplingParams

    runner = ModelRunner(build_tiny_moe(), overlap=OverlapConfig(), num_kv_blocks=64, block_size=4)
    config = EngineConfig(scheduler=SchedulerConfig(max_model_len=16, max_num_seqs=4), max_num_batched_tokens=32)
    engine = build_engine(replace(config, scheduler=replace(config.scheduler, overlap_schedule=False)), runner=runner)
    refused = engine.add_request("long", list(range(1, 11)), SamplingParams(max_tokens=7, ignore_eos=True))
    assert refused is not None and refused.finish_reason == "error" and "context length 16" in refused.error
    assert engine.add_request("fits", list(range(1, 11)), SamplingParams(max_tokens=6, ignore_eos=True)) is None
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "fits") == 6
    with pytest.raises(ValueError, match="over the model's context length"):
        Engine(runner, SchedulerConfig(max_model_len=runner.info.max_model_len + 1))


def test_flags_table_lists_every_visible_flag():
    table = markdown_table()
    for flag in config_flags(*ENGINE_SECTIONS, "http"):
        assert (f"`{flag.declaration}`" in table) != flag.meta["hidden"], flag.param


def test_the_documented_flags_table_is_current(tmp_path):
    from pathlib import Path

    from tandem.cli_options import write_flags_table

    doc = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    copy = tmp_path / "configuration.md"
    copy.write_text(doc.read_text())
    assert not write_flags_table(str(copy)), "run: python -m tandem.cli_options --write docs/configuration.md"


def test_overlap_schedule_is_on_unless_the_forward_holds_every_cpu_core():
    from tandem.config import SchedulerConfig

    auto = SchedulerConfig()
    assert auto.overlap_schedule is None
    assert auto.overlaps_schedule("cuda", forward_threads=16, cores=16)
    assert auto.overlaps_schedule("cpu", forward_threads=1, cores=2)
    assert not auto.overlaps_schedule("cpu", forward_threads=2, cores=2)
    assert SchedulerConfig(overlap_schedule=True).overlaps_schedule("cpu", 2, 2)
    assert not SchedulerConfig(overlap_schedule=False).overlaps_schedule("cuda", 1, 2)


def test_spawned_ranks_share_the_cores_unless_omp_num_threads_says(monkeypatch):
    from tandem.distributed import launch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(launch, "available_cores", lambda: 8)
    assert [launch.threads_per_rank(n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch.threads_per_rank(2) == 3
