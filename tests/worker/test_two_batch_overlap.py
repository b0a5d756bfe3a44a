"""Two-batch overlap (the stages executor) on every model family: the same greedy tokens as
no overlap, on one rank and on two gloo ranks, through decode (delta 2) and prefill
(delta 0) steps, with balanced / two-chunk prefill splits."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tandem.worker.model_runner import tbo_split_point
from tandem.config import CacheConfig, EngineConfig, OverlapConfig, ParallelConfig
from tandem.engine.offline import build_runner, generate
from tandem.worker.sampling import SamplingParams
from tandem.testing import run_distributed

transformers = pytest.importorskip("transformers")

from tests.support.hf_checkpoints import EOS, VOCAB, build_hf_model, save_checkpoint  # noqa: E402

#: Five prompts (three on rank 0, two on rank 1): the prefill (35 and 26 tokens) and the
#: decode steps (3 and 2 tokens) all split into two ubatches on both ranks; the long
#: prompt is cut inside by the prefill split on one rank.
PROMPTS = [
    [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 65, 66, 67, 68, 69, 70, 71],
    [3, 141, 59, 7, 19, 201, 5, 88, 120, 64, 33, 12, 90, 17],
    [26, 53, 58, 97, 93, 23],
    [84, 33, 71, 11, 250, 9, 14, 99, 42, 100, 101, 102],
    [38, 46, 26, 43, 38, 32, 79, 50],
]
MAX_TOKENS = 4


def _deepseek_v2(directory):
    """A DeepSeek-V2 checkpoint: full-rank queries, two shared experts, one dense layer."""
    config = transformers.DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
        topk_method="greedy", first_k_dense_replace=1, max_position_embeddings=256, initializer_range=0.15,
        eos_token_id=EOS,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return save_checkpoint(transformers.DeepseekV2ForCausalLM(config).float().eval(), directory)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """family → model (the built-in DeepSeek-V3-shaped tiny-moe, or a checkpoint directory)."""
    out = {"deepseek_v3": "tiny-moe", "deepseek_v2": str(_deepseek_v2(tmp_path_factory.mktemp("deepseek_v2")))}
    for family in ("qwen2_moe", "qwen3_moe", "mixtral"):
        out[family] = str(save_checkpoint(build_hf_model(family), tmp_path_factory.mktemp(family)))
    return out


def _config(model: str, world: int, tbo: bool) -> EngineConfig:
    return EngineConfig(
        model=model,
        overlap=OverlapConfig(
            enable_dbo=tbo, executor="stages", dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0
        ),
        parallel=ParallelConfig(data_parallel_size=world, all2all_backend="torch_a2a" if world > 1 else "local"),
        cache=CacheConfig(num_kv_blocks=48, block_size=4),
        max_num_batched_tokens=64,
    )


def _generate_all(rank: int, world: int, models: dict[str, str], families: tuple[str, ...]) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    mine = [(i, ids, params) for i, ids in enumerate(PROMPTS) if i % world == rank]
    out = {}
    for family in families:
        model, runs = models[family], []
        for tbo in (False, True):
            runner = build_runner(_config(model, world, tbo), group=group)
            tokens = [c.token_ids for c in generate(runner, mine)]
            runs.append((tokens, runner.ubatched_steps, runner.steps - runner.idle_steps))
        out[family] = runs
    return out


def _check(per_rank: list[dict]) -> None:
    for rank, families in enumerate(per_rank):
        for family, ((plain, plain_ubatched, steps), (tbo, tbo_ubatched, tbo_steps)) in families.items():
            assert tbo == plain, f"{family} rank {rank}"
            assert all(len(t) == MAX_TOKENS for t in tbo), family
            assert plain_ubatched == 0 and tbo_steps == steps, family
            # Prefill and every decode step ran as two ubatches on the stage executor (steps
            # that only found every rank done are not counted).
            assert tbo_ubatched == steps, (family, tbo_ubatched, steps)


def test_every_family_gives_the_no_overlap_greedy_tokens_on_one_rank(models):
    with torch.no_grad():
        _check([_generate_all(0, 1, models, tuple(models))])


@pytest.mark.slow
def test_every_family_gives_the_no_overlap_greedy_tokens_on_two_ranks(models):
    # DeepSeek-V2 shares V3's layers; two ranks run one of them to keep the test short.
    families = ("deepseek_v3", "qwen2_moe", "qwen3_moe", "mixtral")
    _check(run_distributed(_generate_all, 2, models, families, timeout_s=400))


def test_balanced_prefill_split_under_the_stages_executor():
    """SGLang's split for a TBO prefill: at the sequence boundary nearest half the tokens,
    or inside a sequence when that leaves one ubatch under the threshold share."""
    runner = build_runner(_config("tiny-moe", 1, True))
    assert tbo_split_point([4, 4, 8], 2, runner.overlap) == 8  # by sequences
    assert tbo_split_point([14, 2], 2, runner.overlap) == 8  # two-chunk: 14/16 is outside [0.48, 0.52]
    assert tbo_split_point([1, 1, 1], 2, runner.overlap) is None  # decode: by tokens
    assert tbo_split_point([4, 4, 8], 3, runner.overlap) is None  # three ubatches (the planner may pick them): by tokens
    runner.overlap = replace(runner.overlap, tbo_token_distribution_threshold=0.0)
    assert tbo_split_point([14, 2], 2, runner.overlap) == 14
    runner.overlap = replace(runner.overlap, executor="thread")
    assert tbo_split_point([4, 4, 8], 2, runner.overlap) is None
