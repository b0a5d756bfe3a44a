"""What every `torch.compile` call of tandem needs, whatever it compiles: the same dispatch
state on every call, and room for the graphs of several models in one process."""

from __future__ import annotations

import torch


def allow_many_compiled_models() -> None:
    """Dynamo keeps the graphs of one code object (a family's `forward`, the decode attention
    kernel) together and gives up past `recompile_limit` (8): every model instance and every
    attention shape adds its own. A process that builds engines in turn (tests, benchmarks)
    holds many; serving holds one or two."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 256)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4096)


def below_autograd():
    """Dispatch with the autograd keys excluded, whoever calls: dynamo guards on the keys a
    call sees, which differ inside a custom op (where the MoE op's ubatch yields can leave a
    greenlet or thread) and outside one, and each difference would compile again."""
    return torch._C._AutoDispatchBelowADInplaceOrView()


__all__ = ["allow_many_compiled_models", "below_autograd"]
