"""The Triton interpreter's float32 -> bfloat16 cast truncates (`.to(tl.bfloat16)`; even
`fp_downcast_rounding="rtne"` rounds ties away from zero), where a GPU rounds to nearest
even, as torch does. `interpreter_rounds_to_nearest_even(monkeypatch)` makes the
interpreter's cast round as a GPU's does, so a test can hold a kernel's roundings to torch's
bit for bit in bfloat16."""

from __future__ import annotations

import numpy as np
import torch


def interpreter_rounds_to_nearest_even(monkeypatch) -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            as_float = np.ascontiguousarray(values).view(np.float32)
            rounded = torch.from_numpy(as_float.copy()).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().view(np.uint16).reshape(np.shape(values))
        return original(values, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


__all__ = ["interpreter_rounds_to_nearest_even"]
