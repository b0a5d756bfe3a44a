"""A Hugging Face `config.json` as model constructors read it, without needing transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_MISSING = object()


class HFConfig(dict):
    """`config.json` as a dict that also answers attribute access, so model code written for
    a transformers `PretrainedConfig` (`config.hidden_size`, `getattr(config, k, default)`)
    and code written for a dict (`config["hidden_size"]`, `config.get(k)`) both work."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    @classmethod
    def from_file(cls, path: str | Path) -> "HFConfig":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{path} does not hold a JSON object")
        return cls(data)


def as_config(config: Any) -> Any:
    """Dicts become `HFConfig`; anything else (an `HFConfig`, a transformers config, a
    namespace) is used as it is."""
    if isinstance(config, dict) and not isinstance(config, HFConfig):
        return HFConfig(config)
    return config


def config_value(config: Any, *keys: str, default: Any = _MISSING) -> Any:
    """The first of `keys` that `config` sets to something other than None (configs rename
    fields across versions, e.g. Qwen3-MoE `num_experts` / `num_local_experts`)."""
    for key in keys:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if value is not None:
            return value
    if default is _MISSING:
        raise ValueError(f"the model config sets none of {', '.join(keys)}")
    return default


def check_silu(config: Any) -> None:
    act = config_value(config, "hidden_act", default="silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act={act!r} is not supported; the MoE kernels compute silu(gate) * up")
