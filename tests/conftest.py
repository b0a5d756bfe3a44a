"""Suite-wide hooks: tests marked `cuda` run only where a CUDA device exists, and are
skipped with a reason elsewhere, so `python -m pytest -m cuda` and the default run both stay
green on CPU machines."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    build = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU ({build})")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
