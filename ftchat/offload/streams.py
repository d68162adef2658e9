"""Streams and events of the offloaded MoE step, on CUDA and emulated on the CPU.

Jobs: `compute` (the model and every slot-map write), `predictor` (router lookahead),
`copy` (demand copies) and `prefetch` (prefetch copies, highest priority).

The CPU emulation runs compute work at once and defers the other streams' work until someone
waits on one of their events, so a missing wait leaves bytes stale exactly as a race would on the
GPU, deterministically. `current` names the stream whose work is running (the single-writer test
reads it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

StreamName = Literal["compute", "predictor", "copy", "prefetch"]
NAMES: tuple[StreamName, ...] = get_args(StreamName)


@dataclass
class _Queue:
    items: list = field(default_factory=list)  # ("fn", callable) | ("wait", event)
    done: int = 0  # items executed


@dataclass(frozen=True)
class CpuEvent:
    stream: StreamName
    position: int


class _HandOff:
    def hand_off(self, stream: StreamName, *inputs: torch.Tensor) -> None:
        """`stream` waits for all compute work issued so far and keeps `inputs` (what its next
        work reads) alive. Taking the inputs as arguments makes them exist before the event is
        recorded: a tensor the compute stream writes after the record races with the side
        stream (prefill read unwritten int32 counts this way once: illegal address on the GPU
        under load, invisible to this emulation, which runs compute work at once)."""
        self.wait(stream, self.record("compute"))
        self.hold(stream, *inputs)


class CpuStreams(_HandOff):
    """Deferred-execution emulation of CUDA streams for the CPU path and its tests."""

    def __init__(self):
        self.queues = {n: _Queue() for n in NAMES}
        self.current = "compute"

    def run(self, stream: StreamName, fn: Callable[[], None]) -> None:
        if stream == "compute":
            self._call("compute", fn)
        else:
            self.queues[stream].items.append(("fn", fn))

    def record(self, stream: StreamName) -> CpuEvent:
        return CpuEvent(stream, len(self.queues[stream].items))

    def wait(self, stream: StreamName, event: CpuEvent | None) -> None:
        if event is None or event.stream == stream:
            return
        if stream == "compute":
            self._flush(event.stream, event.position)
        else:
            self.queues[stream].items.append(("wait", event))

    def synchronize(self) -> None:
        for n in NAMES[1:]:
            self._flush(n, len(self.queues[n].items))

    def hold(self, stream: StreamName, *tensors: torch.Tensor) -> None:
        """Keep tensors alive for work queued on `stream` (nothing to do here)."""

    def _flush(self, stream: StreamName, upto: int) -> None:
        q = self.queues[stream]
        while q.done < upto:
            kind, obj = q.items[q.done]
            q.done += 1
            if kind == "wait":
                self._flush(obj.stream, obj.position)
            else:
                self._call(stream, obj)

    def _call(self, stream: StreamName, fn: Callable[[], None]) -> None:
        prev, self.current = self.current, stream
        try:
            fn()
        finally:
            self.current = prev


class CudaStreams(_HandOff):
    """Real CUDA streams. `compute` is whatever stream is current when the step runs (the
    default stream, or the capture stream while a CUDA graph records)."""

    def __init__(self, device: torch.device):
        hi = -1  # a higher priority than the default 0: copies jump ahead of queued compute
        self.side = {
            "predictor": torch.cuda.Stream(device),
            "copy": torch.cuda.Stream(device, priority=hi),
            "prefetch": torch.cuda.Stream(device, priority=hi),
        }
        self.current = "compute"

    def _stream(self, name: StreamName) -> torch.cuda.Stream:
        return torch.cuda.current_stream() if name == "compute" else self.side[name]

    def run(self, stream: StreamName, fn: Callable[[], None]) -> None:
        if stream == "compute":
            fn()
            return
        prev, self.current = self.current, stream
        try:
            with torch.cuda.stream(self.side[stream]):
                fn()
        finally:
            self.current = prev

    def record(self, stream: StreamName) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self._stream(stream))
        return ev

    def wait(self, stream: StreamName, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self._stream(stream).wait_event(event)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def hold(self, stream: StreamName, *tensors: torch.Tensor) -> None:
        """Tensors made on the compute stream and read by work on `stream`: the caching allocator
        must not hand their memory out again before that work ran (eager mode; graphs keep
        static memory anyway)."""
        if stream != "compute" and not torch.cuda.is_current_stream_capturing():
            for t in tensors:
                t.record_stream(self.side[stream])


def make_streams(device: torch.device) -> CpuStreams | CudaStreams:
    return CudaStreams(device) if device.type == "cuda" else CpuStreams()
