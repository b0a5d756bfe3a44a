"""`load_model`: sharded checkpoints, expert-parallel loading that reads only this rank's
experts, the built-in preset delegation, and a clear message for every broken directory."""

import json
import re
import shutil
import sys
import types

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.models import ModelInfo
from tandem.modular_kernels import MoEConfig
from tandem.models.loader import load_model, supported_architectures
from tandem.testing.model_harness import GreedyHarness
from tandem.testing import run_distributed
from tests.support.hf_checkpoints import EOS, build_hf_model, hf_logits, save_checkpoint, save_fused_checkpoint, shard_checkpoint

PROMPTS = ([72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33], [3, 141, 59, 26, 53, 58, 97])
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    hf = build_hf_model("qwen2_moe")
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def sharded(qwen2, tmp_path_factory):
    _, source = qwen2
    directory = tmp_path_factory.mktemp("qwen2_sharded")
    for item in source.iterdir():
        shutil.copy(item, directory / item.name)
    shards = shard_checkpoint(directory, num_shards=2)
    return directory, shards


def _copy(source, destination):
    destination.mkdir()
    for item in source.iterdir():
        shutil.copy(item, destination / item.name)
    return destination


def _greedy_logits(model, prompt, steps=3):
    harness = GreedyHarness(model, num_blocks=32, block_size=4)
    seq = {"tokens": list(prompt), "computed": 0}
    out = [harness.step([seq])]
    for _ in range(steps):
        seq["tokens"].append(int(out[-1][-1].argmax()))
        out.append(harness.step([seq]))
    return torch.cat(out), seq["tokens"]


# -- sharded checkpoints ------------------------------------------------------------------


def test_sharded_checkpoint_equals_single_file(qwen2, sharded):
    hf, single_dir = qwen2
    directory, shards = sharded
    assert not (directory / "model.safetensors").exists() and len(shards) == 2
    single = load_model(str(single_dir))
    split = load_model(str(directory))
    for (name, a), (_, b) in zip(single.model.named_parameters(), split.model.named_parameters()):
        assert torch.equal(a, b), name
    logits, tokens = _greedy_logits(split.model, PROMPTS[0])
    assert float((logits[-1] - hf_logits(hf, tokens)[-1]).abs().max()) < 1e-4
    with open(directory / "model.safetensors.index.json") as f:
        assert split.model.checkpoint_tensors_read == set(json.load(f)["weight_map"])


def test_eos_from_generation_config_list_then_config(qwen2, tmp_path):
    _, source = qwen2
    directory = _copy(source, tmp_path / "m")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 7]}))
    assert load_model(str(directory)).eos_token_ids == {EOS, 7}
    (directory / "generation_config.json").unlink()
    assert load_model(str(directory)).eos_token_ids == {EOS}  # config.json's eos_token_id


# -- expert parallelism -------------------------------------------------------------------


class _RecordingSafeOpen:
    """Wraps `safe_open`, logging which tensors (and which rows of sliced ones) are read."""

    def __init__(self, real, log):
        self.real, self.log = real, log

    def __call__(self, *args, **kwargs):
        recorder = self

        class Handle:
            def __enter__(self):
                self.f = recorder.real(*args, **kwargs).__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                recorder.log.append((name, None))
                return self.f.get_tensor(name)

            def get_slice(self, name):
                real = self.f.get_slice(name)

                class Slice:
                    def __getitem__(self, index):
                        recorder.log.append((name, (index.start, index.stop)))
                        return real[index]

                return Slice()

        return Handle()


def _ep_rank(rank, world, per_expert_dir, fused_dir):
    import torch.distributed as dist

    from tandem.models import loader as rank_loader

    log = []
    rank_loader.safe_open = _RecordingSafeOpen(rank_loader.safe_open, log)
    out = {}
    for key, directory, num_experts in (("qwen2", per_expert_dir, 4), ("mixtral", fused_dir, 8)):
        log.clear()
        ep = load_model(directory, MoEConfig(all2all_backend="torch_a2a", group=dist.group.WORLD))
        reads = list(log)
        local = range(rank * num_experts // world, (rank + 1) * num_experts // world)
        shapes = [
            (tuple(m.experts.w13.shape), tuple(m.experts.w2.shape))
            for m in ep.model.modules()
            if hasattr(m, "experts") and hasattr(m.experts, "w13")
        ]
        foreign = [name for name, _ in reads if (m := _EXPERT.search(name)) and int(m.group(1)) not in local]
        slices = sorted({rows for name, rows in reads if rows is not None})
        rank_loader.safe_open = rank_loader.safe_open.real
        reference = load_model(directory)  # one rank, every expert, no communication
        rank_loader.safe_open = _RecordingSafeOpen(rank_loader.safe_open, log)
        prompt = PROMPTS[rank]  # different tokens per rank: experts serve the other rank's tokens
        ep_logits, ep_tokens = _greedy_logits(ep.model, prompt)
        ref_logits, ref_tokens = _greedy_logits(reference.model, prompt)
        out[key] = {
            "shapes": shapes,
            "foreign_reads": foreign,
            "read_names": sorted({name for name, _ in reads}),
            "slices": slices,
            "max_diff": float((ep_logits - ref_logits).abs().max()),
            "same_tokens": ep_tokens == ref_tokens,
            "read_attr_ok": ep.model.checkpoint_tensors_read == {name for name, _ in reads},
        }
    return out


@pytest.mark.slow
def test_expert_parallel_loading_reads_only_local_experts(qwen2, sharded, tmp_path):
    directory, _ = sharded
    fused = save_fused_checkpoint(build_hf_model("mixtral"), tmp_path / "mixtral_fused")
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    results = run_distributed(_ep_rank, 2, str(directory), str(fused), timeout_s=120)
    for rank, result in enumerate(results):
        qwen, mixtral = result["qwen2"], result["mixtral"]
        # Qwen2: layer 0 is dense, layer 1 holds 2 of 4 experts (I = 32, H = 64).
        assert qwen["shapes"] == [((2, 64, 64), (2, 64, 32))]
        assert qwen["foreign_reads"] == []
        expected = {n for n in weight_map if not (m := _EXPERT.search(n)) or int(m.group(1)) // 2 == rank}
        assert qwen["read_names"] == sorted(expected)
        # Mixtral, fused 3-D experts: only this rank's rows [4r, 4r + 4) of each were read.
        assert mixtral["shapes"] == [((4, 64, 64), (4, 64, 32))] * 2
        assert mixtral["slices"] == [(4 * rank, 4 * rank + 4)]
        for case in (qwen, mixtral):
            assert case["max_diff"] < 1e-4, (rank, case)
            assert case["same_tokens"] and case["read_attr_ok"]


# -- the built-in preset ------------------------------------------------------------------


def test_tiny_moe_delegates_to_build_tiny_moe(monkeypatch):
    calls = []
    sentinel = ModelInfo(model=None, tokenizer=None, name="tiny-moe")

    def build_tiny_moe(moe):
        calls.append(moe)
        return sentinel

    fake = types.ModuleType("tandem.models.tiny_moe")
    fake.build_tiny_moe = build_tiny_moe
    monkeypatch.setitem(sys.modules, "tandem.models.tiny_moe", fake)
    options = MoEConfig()
    assert load_model("tiny-moe", options) is sentinel
    assert calls == [options]


# -- errors -------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        load_model(str(tmp_path / "nope"))


def test_no_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(str(tmp_path))


def test_unknown_architecture_lists_supported(qwen2, tmp_path):
    directory = _copy(qwen2[1], tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported model architecture 'LlamaForCausalLM'") as err:
        load_model(str(directory))
    for name in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        assert name in str(err.value)
    assert set(supported_architectures()) >= {"MixtralForCausalLM", "DeepseekV3ForCausalLM"}


def test_missing_weight_files(qwen2, tmp_path):
    directory = _copy(qwen2[1], tmp_path / "m")
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no weights in .*model\.safetensors.*pytorch_model\.bin"):
        load_model(str(directory))


def test_index_references_missing_shard(sharded, tmp_path):
    directory = _copy(sharded[0], tmp_path / "m")
    (directory / sharded[1][1]).unlink()
    with pytest.raises(FileNotFoundError, match=rf"references shard\(s\) missing .*{re.escape(sharded[1][1])}"):
        load_model(str(directory))


def _rewrite(directory, edit):
    path = directory / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    edit(tensors)
    save_file(tensors, str(path))


def test_unloaded_parameters_are_named(qwen2, tmp_path):
    directory = _copy(qwen2[1], tmp_path / "m")

    def drop(tensors):
        del tensors["model.norm.weight"]
        del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]

    _rewrite(directory, drop)
    with pytest.raises(ValueError, match=r"unloaded") as err:
        load_model(str(directory))
    assert "model.norm.weight" in str(err.value)
    assert "model.layers.1.mlp.experts.w13" in str(err.value)
    assert "experts.w2" not in str(err.value)


def test_unknown_and_misshaped_tensors(qwen2, tmp_path):
    directory = _copy(qwen2[1], tmp_path / "m")
    _rewrite(directory, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mystery\.weight"):
        load_model(str(directory))
    directory = _copy(qwen2[1], tmp_path / "n")
    _rewrite(directory, lambda t: t.__setitem__("model.norm.weight", torch.ones(3)))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(3,\).*\(64,\)"):
        load_model(str(directory))


def test_no_tokenizer_json(qwen2, tmp_path):
    directory = _copy(qwen2[1], tmp_path / "m")
    (directory / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        load_model(str(directory))


def test_a_context_past_the_rotary_table_is_refused():
    """The RoPE kernels index the cos/sin table by position without a bound check (on a GPU
    that check would be a host sync), so the longest context must fit the table."""
    import dataclasses

    info = load_model("tiny-moe")
    assert dataclasses.replace(info, max_model_len=info.max_model_len).max_model_len == info.max_model_len
    with pytest.raises(ValueError, match=f"past the rotary table's {info.max_model_len} positions"):
        dataclasses.replace(info, max_model_len=info.max_model_len + 1)
