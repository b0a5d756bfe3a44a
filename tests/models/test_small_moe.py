"""The `small-moe` preset: a built-in model, seeded, identical on every rank layout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tandem.models.loader import load_tokenizer_info, num_hidden_layers
from tandem.models.small_moe import CONFIG, build_small_moe, small_moe_tensor


def test_small_moe_has_the_promised_shape():
    assert (CONFIG["hidden_size"], CONFIG["num_hidden_layers"], CONFIG["first_k_dense_replace"]) == (1024, 5, 1)
    assert (CONFIG["n_routed_experts"], CONFIG["num_experts_per_tok"], CONFIG["n_shared_experts"]) == (16, 2, 1)
    assert CONFIG["moe_intermediate_size"] == 512
    assert num_hidden_layers("small-moe") == 5
    info = load_tokenizer_info("small-moe")
    assert info.tokenizer.encode("hi").ids == [ord("h"), ord("i")] and info.name == "small-moe"


def test_the_model_holds_the_seeded_checkpoint_tensors():
    experts = build_small_moe().model.model.layers[1].mlp.experts
    gate = small_moe_tensor("model.layers.1.mlp.experts.8.gate_proj.weight")
    down = small_moe_tensor("model.layers.1.mlp.experts.8.down_proj.weight")
    assert torch.equal(experts.w13[8, : gate.shape[0]], gate) and torch.equal(experts.w2[8], down)
    # Drawn per tensor name: the same values whatever else was drawn before.
    small_moe_tensor.cache_clear()
    assert torch.equal(small_moe_tensor("model.layers.1.mlp.experts.8.gate_proj.weight"), gate)


def _generate(*args: str) -> list[list[int]]:
    result = subprocess.run(
        [sys.executable, "-m", "tandem", "generate", "Experts everywhere", "Hi", "--model", "small-moe",
         "--max-tokens", "4", "--ignore-eos", "--temperature", "0", "--json", *args],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line)["token_ids"] for line in result.stdout.splitlines()]


@pytest.mark.slow
def test_generate_on_small_moe_is_deterministic_and_two_ranks_agree_with_one():
    single = _generate()
    assert [len(ids) for ids in single] == [4, 4]
    # Pinned: the preset's weights are the same on every machine.
    assert single == [[91, 71, 95, 75], [120, 67, 100, 73]]
    two = _generate("--data-parallel-size", "2", "--enable-dbo", "--dbo-decode-token-threshold", "0",
                    "--dbo-prefill-token-threshold", "0")
    assert two == single
