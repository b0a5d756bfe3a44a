"""Loading a model from a Hugging Face model directory (or the built-in `tiny-moe` preset).

A directory holds `config.json`, `model.safetensors` or a sharded
`model.safetensors.index.json` + shards, `tokenizer.json` and optionally
`generation_config.json`. Only the tensors this expert-parallel rank needs are read:
experts other ranks hold are skipped by name before any of their bytes are loaded.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open

from tandem.models.base import CausalLM, ModelInfo
from tandem.modular_kernels import MoEConfig
from tandem.models.hf_config import HFConfig, config_value

#: The model families: HF `model_type` -> (architecture, the module defining the class of
#: that name). Adding a family is its module plus one row here.
FAMILIES: dict[str, tuple[str, str]] = {
    "deepseek_v2": ("DeepseekV2ForCausalLM", "tandem.models.deepseek"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "tandem.models.deepseek"),
    "mixtral": ("MixtralForCausalLM", "tandem.models.mixtral"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "tandem.models.qwen_moe"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "tandem.models.qwen_moe"),
}

#: `config.json` `architectures[0]` -> "module:class" (imported on use).
MODEL_REGISTRY: dict[str, str] = {arch: f"{module}:{arch}" for arch, module in FAMILIES.values()}

#: Names `load_model` accepts instead of a path.
BUILTIN_MODELS: dict[str, str] = {
    "tiny-moe": "tandem.models.tiny_moe:build_tiny_moe",
    # Same family, hidden 1024: a step whose cost is tensor work (real-link benchmarks).
    "small-moe": "tandem.models.small_moe:build_small_moe",
    # GPU benchmarks: V2-Lite's shape with random weights drawn on the device (~31 GB bf16).
    "deepseek-v2-lite-random": "tandem.models.random_deepseek:build_random_deepseek_v2_lite",
}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _import(target: str) -> Any:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def model_class(architecture: str) -> type[CausalLM]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    return _import(MODEL_REGISTRY[architecture])


def read_config(path: Path) -> HFConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face model directory")
    try:
        return HFConfig.from_file(config_file)
    except (json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from exc


def architecture_of(config: HFConfig, config_file: Path) -> str:
    architectures = config.get("architectures")
    if architectures:
        return architectures[0]
    model_type = config.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type][0]
    raise ValueError(
        f"{config_file} names no architecture ('architectures' is missing and model_type={model_type!r} "
        f"is not known); supported: {', '.join(supported_architectures())}"
    )


def checkpoint_shards(path: Path) -> dict[Path, list[str] | None]:
    """Each safetensors file → the tensor names to take from it (None: all of them)."""
    index_file = path / INDEX_FILE
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index_file} is not a safetensors index with a 'weight_map': {exc}") from exc
        shards: dict[Path, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(path / shard, []).append(name)
        missing = sorted(str(shard.name) for shard in shards if not shard.is_file())
        if missing:
            raise FileNotFoundError(f"{index_file} references shard(s) missing from {path}: {', '.join(missing)}")
        return shards
    single = path / SINGLE_FILE
    if single.is_file():
        return {single: None}
    others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
    hint = f" (found {', '.join(others)}; only {SINGLE_FILE} or a sharded {INDEX_FILE} are read)" if others else ""
    raise FileNotFoundError(f"no weights in {path}: expected {SINGLE_FILE} or {INDEX_FILE}{hint}")


def iter_checkpoint(
    shards: dict[Path, list[str] | None],
    select: Callable[[str], bool | range] | None = None,
    read: set[str] | None = None,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for the tensors `select(name)` asks for: True whole, False
    skipped unread, a range only those rows of dim 0. Names read are added to `read`.
    Tensors are read straight onto `device` (safetensors copies each one there as it loads)."""
    for shard, names in shards.items():
        with safe_open(str(shard), framework="pt", device=str(device)) as f:
            for name in f.keys() if names is None else names:
                choice = True if select is None else select(name)
                if choice is False:
                    continue
                if isinstance(choice, range):
                    tensor = f.get_slice(name)[choice.start : choice.stop]
                else:
                    tensor = f.get_tensor(name)
                if read is not None:
                    read.add(name)
                yield name, tensor


def _count_tensors(shard: Path) -> int:
    with safe_open(str(shard), framework="pt") as f:
        return len(list(f.keys()))


def _eos_token_ids(path: Path, config: HFConfig) -> set[int]:
    value = None
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        value = json.loads(generation_file.read_text(encoding="utf-8")).get("eos_token_id")
    if value is None:
        value = config.get("eos_token_id")
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def _load_builtin(name: str, moe: MoEConfig | None, dtype: torch.dtype, device: torch.device, stage=None) -> ModelInfo:
    build = _import(BUILTIN_MODELS[name])
    accepted = inspect.signature(build).parameters
    kwargs = {key: value for key, value in (("dtype", dtype), ("device", device)) if key in accepted}
    if stage is not None:
        if "stage" not in accepted:
            raise ValueError(f"the built-in model {name!r} cannot be split into pipeline stages")
        kwargs["stage"] = stage
    if "device" not in accepted:
        with torch.device(device):
            return build(moe, **kwargs)
    return build(moe, **kwargs)


def load_model(
    path_or_name: str,
    moe: MoEConfig | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    stage=None,
) -> ModelInfo:
    """Build and fill the model for this rank on `device`, with its tokenizer and stop tokens.
    Parameters are allocated on `device` and the checkpoint is read straight onto it. `stage`
    (a `tandem.distributed.StageLayers`) builds and reads only that pipeline stage's layers."""
    device = torch.device(device)
    if str(path_or_name) in BUILTIN_MODELS:
        return _load_builtin(str(path_or_name), moe, dtype, device, stage)
    path = Path(path_or_name).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist (built-in models: {', '.join(sorted(BUILTIN_MODELS))})"
        )
    if not path.is_dir():
        raise NotADirectoryError(f"model path {str(path)!r} is not a directory")
    config = read_config(path)
    cls = model_class(architecture_of(config, path / "config.json"))
    shards = checkpoint_shards(path)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}: tandem reads the fast-tokenizer file")

    with torch.device(device):
        model = cls(config, moe=moe, dtype=dtype, **({"stage": stage} if stage is not None else {}))
    select = getattr(model, "checkpoint_selection", None) or model.owns_checkpoint_tensor
    read: set[str] = set()
    tensors = iter_checkpoint(shards, select, read, device)
    if (moe is None or moe.ep_rank == 0) and sys.stderr.isatty():
        from tqdm import tqdm

        total = sum(len(names) if names is not None else _count_tensors(shard) for shard, names in shards.items())
        tensors = tqdm(tensors, total=total, desc=f"loading {path.name}", unit="tensor", file=sys.stderr, leave=False)
    loaded = model.load_weights(tensors)
    unloaded = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if unloaded:
        shown = ", ".join(unloaded[:20]) + (f", ... ({len(unloaded)} in all)" if len(unloaded) > 20 else "")
        raise ValueError(f"the checkpoint in {path} left parameters of {cls.__name__} unloaded: {shown}")
    model.checkpoint_tensors_read = frozenset(read)
    model.prepare_weights_after_loading()
    model.eval()

    from tokenizers import Tokenizer

    max_model_len = int(config_value(config, "max_position_embeddings", default=4096))
    window = model.sliding_window() if callable(getattr(model, "sliding_window", None)) else None
    if window:
        max_model_len = min(max_model_len, int(window))
    return ModelInfo(
        model=model,
        tokenizer=Tokenizer.from_file(str(tokenizer_file)),
        eos_token_ids=_eos_token_ids(path, config),
        max_model_len=max_model_len,
        name=path.name,
    )


@dataclass
class TokenizerInfo:
    """What a front end needs of a model without loading its weights."""

    tokenizer: Any
    eos_token_ids: set[int]
    max_model_len: int
    chat_template: str | None
    name: str


def _builtin_config(name: str) -> dict:
    """A built-in model's HF-style config, without building it."""
    from tandem.models import random_deepseek, small_moe, tiny_moe

    return {
        "tiny-moe": tiny_moe.CONFIG,
        "small-moe": small_moe.CONFIG,
        "deepseek-v2-lite-random": random_deepseek.DEEPSEEK_V2_LITE,
    }[name]


def load_tokenizer_info(path_or_name: str) -> TokenizerInfo:
    """Tokenizer, stop tokens, context length and chat template of a model directory (or
    a built-in model), with the same errors `load_model` gives for a bad directory."""
    if str(path_or_name) in BUILTIN_MODELS:
        from tandem.models import tiny_moe

        config = _builtin_config(str(path_or_name))
        # Every built-in model uses the byte tokenizer.
        return TokenizerInfo(
            tiny_moe.build_tokenizer(), {tiny_moe.EOS_ID}, config["max_position_embeddings"], None, str(path_or_name)
        )
    path = Path(path_or_name).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist or is not a directory (built-in models: {', '.join(sorted(BUILTIN_MODELS))})"
        )
    config = read_config(path)
    architecture_of(config, path / "config.json")
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}: tandem reads the fast-tokenizer file")
    from tokenizers import Tokenizer

    chat_template = None
    tokenizer_config = path / "tokenizer_config.json"
    if tokenizer_config.is_file():
        try:
            chat_template = json.loads(tokenizer_config.read_text(encoding="utf-8")).get("chat_template")
        except json.JSONDecodeError as exc:
            raise ValueError(f"{tokenizer_config} is not valid JSON: {exc}") from exc
        if isinstance(chat_template, list):  # named templates: take the default one
            chat_template = next((t.get("template") for t in chat_template if t.get("name") == "default"), None)
    return TokenizerInfo(
        Tokenizer.from_file(str(tokenizer_file)),
        _eos_token_ids(path, config),
        int(config_value(config, "max_position_embeddings", default=4096)),
        chat_template,
        path.name,
    )


def num_hidden_layers(path_or_name: str) -> int:
    """The decoder layer count of a model directory (or a built-in model), from its config
    alone: what a pipeline stage needs to know which layers are its own before loading."""
    if str(path_or_name) in BUILTIN_MODELS:
        return int(_builtin_config(str(path_or_name))["num_hidden_layers"])
    path = Path(path_or_name).expanduser()
    return int(config_value(read_config(path), "num_hidden_layers"))
