"""The DeepSeek-V2-Lite-shaped random model: the real shape on paper, built and run at a tiny
scale on CPU, seeded."""

from __future__ import annotations

import torch

from tandem.models.deepseek import DeepseekConfig
from tandem.models.loader import BUILTIN_MODELS, load_tokenizer_info
from tandem.models.random_deepseek import DEEPSEEK_V2_LITE, build_random_deepseek_v2_lite
from tandem.worker.step_inputs import ScheduledChunk
from tandem.worker.model_runner import ModelRunner
from tandem.worker.sampling import SamplingParams

TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            n_routed_experts=8, vocab_size=320, max_position_embeddings=256)


def test_the_preset_has_deepseek_v2_lite_shape():
    cfg = DeepseekConfig.from_hf(DEEPSEEK_V2_LITE, 2)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == (2048, 27, 64, 6)
    assert cfg.n_shared_experts == 2 and cfg.kv_lora_rank == 512 and cfg.q_lora_rank is None
    assert "deepseek-v2-lite-random" in BUILTIN_MODELS
    assert load_tokenizer_info("deepseek-v2-lite-random").max_model_len == DEEPSEEK_V2_LITE["max_position_embeddings"]


def test_tiny_scale_builds_seeded_and_runs_a_step():
    a = build_random_deepseek_v2_lite(dtype=torch.float32, overrides=TINY)
    b = build_random_deepseek_v2_lite(dtype=torch.float32, overrides=TINY)
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), name
    moe_layers = [layer for layer in a.model.model.layers if layer.is_sparse]
    assert len(moe_layers) == 2 and moe_layers[0].mlp.experts.w13.shape[0] == 8
    runner = ModelRunner(a, num_kv_blocks=8, block_size=4)
    result = runner.execute([ScheduledChunk([1, 2, 3, 4, 5], 0, runner.allocator.allocate(2))], [SamplingParams(temperature=0)], [None])
    assert isinstance(result.tokens[0], int) and 0 <= result.tokens[0] < 320
