"""MLA's prefill in the per-head form (gpu-review-3 G3): the cached latent expanded through
`kv_b_proj` and plain multi-head attention at d_qk 192 / d_v 128 give what the absorbed
(latent) form gives, in every case the varlen path has (fresh prompts of several lengths,
equal-length runs, chunks over a cached context, decodes and padding rows in the same step),
and it is the form a prefill takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.models import mla_prefill
from tandem.models.deepseek_config import DeepseekConfig
from tandem.models.random_deepseek import DEEPSEEK_V2_LITE
from tests.support.mla_layers import CHUNKED, FRESH, SHAPES
from tests.support.mla_layers import mla_config as _config
from tests.support.mla_layers import mla_layer as _layer
from tests.support.mla_layers import run_mla_steps as _run

def _forced(monkeypatch, form: str) -> None:
    monkeypatch.setattr(mla_prefill, "per_head_pays", lambda *args: form == "per_head")


@pytest.mark.parametrize("steps", [FRESH, CHUNKED], ids=["fresh", "chunked"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_prefill_matches_the_latent_form(steps, shape, dtype, monkeypatch):
    cfg = _config(shape)
    layer = _layer(cfg, dtype)
    pad = 3 if steps is CHUNKED else 0
    _forced(monkeypatch, "per_head")
    per_head = _run(layer, steps, pad)
    _forced(monkeypatch, "latent")
    latent = _run(layer, steps, pad)
    reference = _run(_layer(cfg, torch.float32, mode="expanded"), steps, pad)  # per-head K/V cached
    # bfloat16: outputs of magnitude ~3 are 1-2 bf16 steps (1.6e-2) apart at most.
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (4e-2, 2e-2)
    for a, b, ref in zip(per_head, latent, reference, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
        torch.testing.assert_close(a, ref, atol=atol, rtol=rtol)
    if pad:
        assert per_head[-1][-pad:].abs().max() == 0  # padding rows attend to nothing


def _sdpa_calls(monkeypatch) -> list[tuple[int, int, int, int]]:
    """(query heads, key heads, d_qk, d_v) of every SDPA call from here on."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_a_prefill_takes_the_per_head_form_and_a_decode_the_latent_one(monkeypatch):
    """DeepSeek-V2-Lite's attention dims: a fresh prompt (and a long chunk after a short
    context) attends per head at d_qk 192 / d_v 128 over 16 KV heads; a short chunk after a
    longer context, where expanding the context costs more than it saves, and a decode stay
    in the 576 / 512 latent over one KV head."""
    cfg = DeepseekConfig.from_hf(dict(DEEPSEEK_V2_LITE, hidden_size=64), 2)
    layer = _layer(cfg, torch.float32)
    calls = _sdpa_calls(monkeypatch)
    per_head, latent = (16, 16, 192, 128), (16, 1, 576, 512)
    _run(layer, [[(40, 0)], [(100, 40)], [(8, 140)]])
    assert calls == [per_head, per_head, latent]
    calls.clear()
    forms = []
    for form in ("_absorbed", "_per_head"):
        real = getattr(mla_prefill, form)
        spy = lambda *a, real=real, form=form: forms.append((form, a[1].shape[0])) or real(*a)  # noqa: E731
        monkeypatch.setattr(mla_prefill, form, spy)
    # A mixed step: a decode (the in-place CPU kernel or latent SDPA) and a fresh prompt.
    _run(layer, [[(40, 0)], [(1, 40), (30, 0)]])
    assert forms == [("_per_head", 40), ("_absorbed", 1), ("_per_head", 30)]
    assert calls[:1] == [per_head] and calls[1:-1] in ([], [latent]) and calls[-1] == per_head


def test_per_head_pays_is_the_flop_crossover():
    """V2/V3: expanding a key costs 2 * 512 * 256 FLOPs per head, each query-key pair saves
    2 * (1088 - 320): a fresh prompt always takes the per-head form, a decode never, and a
    chunk over a long context from ~171 query rows."""
    cfg = DeepseekConfig.from_hf(dict(DEEPSEEK_V2_LITE), 2)
    assert all(mla_prefill.per_head_pays(cfg, n, n) for n in (2, 17, 1024, 8192))
    assert not any(mla_prefill.per_head_pays(cfg, 1, n) for n in (2, 64, 4096))
    assert not mla_prefill.per_head_pays(cfg, 170, 100_000)
    assert mla_prefill.per_head_pays(cfg, 172, 100_000)
    assert mla_prefill.per_head_pays(cfg, 512, 1024) and not mla_prefill.per_head_pays(cfg, 64, 4096)
