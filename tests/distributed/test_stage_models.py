"""A model split into pipeline stages computes what the whole model computes: stage 0's
hidden states fed to stage 1 give the whole model's logits, each stage holds only its own
layers' parameters and KV caches, and the loader reads only the stage's tensors."""

from __future__ import annotations

import pytest
import torch

from tandem.contexts import ForwardContext, set_forward_context
from tandem.distributed import MissingLayer, stage_layers
from tandem.models.loader import load_model, num_hidden_layers
from tandem.worker.step_inputs import ScheduledChunk, build_step_inputs
from tandem.worker.kv_cache import allocate_kv_caches
from tests.support.hf_checkpoints import FAMILIES, build_hf_model, save_checkpoint

BLOCK = 4


@pytest.fixture(scope="module", params=["tiny-moe", *FAMILIES])
def model_path(request, tmp_path_factory):
    if request.param == "tiny-moe":
        return "tiny-moe"
    return str(save_checkpoint(build_hf_model(request.param), tmp_path_factory.mktemp(request.param)))


def _prefill_then_decode(models, prompt: list[int], steps: int = 3) -> torch.Tensor:
    """Greedy logits of the last token per step, running `models` one after the other."""
    for model in models:
        model.bind_kv_cache(allocate_kv_caches(model.kv_cache_specs(), 16, BLOCK))
    tokens, computed, out = list(prompt), 0, []
    for _ in range(steps):
        inputs = build_step_inputs([ScheduledChunk(tokens[computed:], computed, list(range(1, 9)))], BLOCK)
        with set_forward_context(ForwardContext(attn_metadata=inputs.attn_metadata)), torch.no_grad():
            x = inputs.input_ids
            for model in models:
                x = model(x, inputs.positions)
            logits = models[-1].compute_logits(x[-1:])
        out.append(logits)
        computed = len(tokens)
        tokens.append(int(logits.argmax()))
    return torch.cat(out)


def test_two_stages_chain_to_the_whole_model(model_path):
    layers = num_hidden_layers(model_path)
    whole = load_model(model_path).model
    stages = [load_model(model_path, stage=stage_layers(layers, s, 2)).model for s in range(2)]
    expected = _prefill_then_decode([whole], [5, 6, 7, 8, 9])
    got = _prefill_then_decode(stages, [5, 6, 7, 8, 9])
    torch.testing.assert_close(got, expected)
    first, last = stages
    assert isinstance(first.model.norm, MissingLayer) and isinstance(last.model.layers[0], MissingLayer)
    assert len(first.kv_cache_specs()) + len(last.kv_cache_specs()) == layers
    whole_params = sum(p.numel() for p in whole.parameters())
    assert sum(p.numel() for m in stages for p in m.parameters()) <= whole_params + whole.model.embed_tokens.weight.numel()
    if model_path != "tiny-moe":
        read = first.checkpoint_tensors_read
        assert not any(name.startswith(("lm_head", "model.norm", f"model.layers.{layers - 1}.")) for name in read)
