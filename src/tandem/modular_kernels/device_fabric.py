"""The modelled interconnect on the device itself, for one GPU: each transfer's arrival is a
spin kernel on the comm stream lasting the fabric model's time.

With one GPU there is no all-to-all to overlap, so a benchmark cannot show what DBO and SBO
buy on a real fabric. `DeviceFabricPrepareAndFinalize` wraps a one-rank backend (the data is
already where the experts are) and makes every dispatch and combine look like a transfer on
real streams: the sender records an event on its stream, the comm stream waits for it and
runs a spin kernel (`torch.cuda._sleep`) for `fabric.transfer_time(bytes)`, and the receiver
makes its stream wait for the spin's end. The host never waits, so under DBO the other
ubatch's kernels queue behind the sender's and run on the compute stream while the spin
occupies the comm stream: the overlap a real fabric would allow, timed by the GPU itself.

Bytes are what a DeepEP-style transfer would move for this rank: every token once per
selected expert, in the activation dtype, for dispatch and for combine; they come from
shapes only (no host read). The spin's clock is measured once per device with CUDA events.
On CPU the spin is a host sleep (no streams to overlap on): results stay exact, which is
what the CPU tests check.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch

from tandem.contexts.ubatch_context import current_ubatch_context
from tandem.modular_kernels.fabric import FabricModel
from tandem.modular_kernels.interfaces import PrepareAndFinalize
from tandem.platform import Platform, get_platform


@functools.lru_cache(maxsize=None)
def spin_cycles_per_second(device_index: int) -> float:
    """Clock cycles per second of `torch.cuda._sleep` on this GPU, measured with events."""
    with torch.cuda.device(device_index):
        torch.cuda._sleep(1_000_000)  # warm-up: clocks up, module loaded
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 50_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) / 1e3)


def spin(seconds: float, stream, device: torch.device) -> None:
    """Occupy `stream` for `seconds` (CUDA: a spin kernel; CPU: the host sleeps)."""
    if device.type == "cuda":
        cycles = int(seconds * spin_cycles_per_second(device.index or 0))
        if cycles > 0:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
    elif seconds > 0:
        time.sleep(seconds)


class DeviceFabricPrepareAndFinalize(PrepareAndFinalize):
    def __init__(self, inner: PrepareAndFinalize, fabric: FabricModel, platform: Platform | None = None):
        if inner.world_size != 1:
            raise ValueError(f"the on-device fabric models one rank's transfers; {inner.name!r} spans {inner.world_size}")
        super().__init__(inner.num_experts)
        self.inner = inner
        self.fabric = fabric
        self.activation_format = inner.activation_format
        self.name = f"{inner.name}+device-fabric"
        # What the wrapped backend says of itself holds for the wrapper too.
        self.graph_capturable = inner.graph_capturable
        self.yields_in_send = inner.yields_in_send
        self.dispatches_ue8m0 = inner.dispatches_ue8m0
        self.compiles_on_first_use = inner.compiles_on_first_use
        self.combine_is_identity = inner.combine_is_identity  # the modelled transfer moves no data
        self.survives_failed_step = getattr(inner, "survives_failed_step", True)
        self._platform = platform
        self._own_comm_stream = None

    @property
    def moves_tokens(self) -> bool:
        return True  # one rank, but every dispatch and combine is a modelled transfer

    def supports_async(self) -> bool:
        return True

    def _comm_stream(self, platform: Platform):
        ubatch = current_ubatch_context()
        if ubatch is not None:
            return ubatch.comm_stream
        if self._own_comm_stream is None:  # outside DBO (SBO, no overlap): a stream of our own
            self._own_comm_stream = platform.new_stream()
        return self._own_comm_stream

    def _transfer(self, like: torch.Tensor, nbytes: int) -> Callable[[], None]:
        """Issue one modelled transfer after the work queued so far; return the wait that
        makes the receiver's stream depend on its arrival."""
        platform = self._platform or get_platform(like.device)
        comm = self._comm_stream(platform)
        sent = platform.new_event()
        sent.record()
        sent.wait(comm)
        spin(self.fabric.transfer_time(nbytes), comm, like.device)
        arrived = platform.new_event()
        arrived.record(comm)
        return arrived.wait

    @staticmethod
    def _pair_bytes(hidden: torch.Tensor, topk_ids: torch.Tensor) -> int:
        return topk_ids.shape[0] * topk_ids.shape[1] * hidden.shape[1] * hidden.element_size()

    def _then_modelled(self, send_inner, like: torch.Tensor, nbytes: int):
        """The wrapped backend's send, then the modelled transfer of `nbytes`: the wrapped
        receive hook runs at once, the receiver waits for the modelled arrival first."""

        def send():
            hook, receive = send_inner()
            if hook is not None:
                hook()
            arrival = self._transfer(like, nbytes)

            def receiver():
                arrival()
                return receive()

            return None, receiver

        return send

    def prepare_before_send(self, hidden, topk_weights, topk_ids, *, use_fp8, ue8m0=False):
        # The wrapped backend's halves (it may `yields_in_send`, as the wrapper says), with the
        # modelled transfer issued by the send, after the wrapped one.
        send_inner = self.inner.prepare_before_send(hidden, topk_weights, topk_ids, use_fp8=use_fp8, ue8m0=ue8m0)
        return self._then_modelled(send_inner, hidden, self._pair_bytes(hidden, topk_ids))

    def prepare_async(self, hidden, topk_weights, topk_ids, *, use_fp8, ue8m0=False):
        return self.prepare_before_send(hidden, topk_weights, topk_ids, use_fp8=use_fp8, ue8m0=ue8m0)()

    def finalize_before_send(self, expert_output, tokens, topk_weights, topk_ids):
        send_inner = self.inner.finalize_before_send(expert_output, tokens, topk_weights, topk_ids)
        return self._then_modelled(send_inner, expert_output, self._pair_bytes(expert_output, topk_ids))

    def finalize_async(self, expert_output, tokens, topk_weights, topk_ids):
        return self.finalize_before_send(expert_output, tokens, topk_weights, topk_ids)()

def install_device_fabric(model: torch.nn.Module, fabric: FabricModel | None) -> int:
    """Model `fabric` on the device for every MoE kernel of `model` (None: remove it);
    returns how many kernels were changed."""
    from tandem.modular_kernels.kernel import FusedMoEModularKernel

    changed = 0
    for module in model.modules():
        kernel = getattr(module, "kernel", None)
        if not isinstance(kernel, FusedMoEModularKernel):
            continue
        inner = kernel.prepare_finalize
        if isinstance(inner, DeviceFabricPrepareAndFinalize):
            inner = inner.inner
        kernel.prepare_finalize = inner if fabric is None else DeviceFabricPrepareAndFinalize(inner, fabric)
        changed += 1
    return changed


__all__ = ["DeviceFabricPrepareAndFinalize", "install_device_fabric", "spin", "spin_cycles_per_second"]
