"""What one call costs on the device: CUDA kernels launched and device busy time (torch.profiler).

For bench's "kernels per step" beside tok/s: profile one decode step (a graph replay or an eager
step) and divide by the layer count for the per-layer figures. Copies and memsets are not
kernels and are not counted; a CUDA graph's kernels are (CUPTI reports each kernel node).
The profiler slows the call: busy time is the device's, not a tok/s figure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

NOT_KERNELS = ("Memcpy", "Memset")  # kineto's names for copy and memset activities


@dataclass(frozen=True)
class CallProfile:
    """Device work of one call."""

    kernels: int  # kernel launches (graph kernel nodes included)
    busy_us: float  # time any kernel ran: the union of their intervals (streams overlap)
    by_name: dict[str, tuple[int, float]] = field(default_factory=dict)  # name -> (launches, us)

    def top(self, n: int = 12) -> list[tuple[str, int, float]]:
        """The n kernels that took the most device time: (name, launches, total us)."""
        rows = sorted(self.by_name.items(), key=lambda kv: -kv[1][1])[:n]
        return [(name, count, round(us, 1)) for name, (count, us) in rows]

    def per_layer(self, layers: int) -> tuple[float, float]:
        """(kernels, busy us) per layer of a `layers`-layer step."""
        return self.kernels / layers, self.busy_us / layers


def profile_call(fn: Callable[[], object], device: str | torch.device) -> CallProfile | None:
    """Run fn once under the profiler and count its kernels; None (fn not run) off CUDA.

    Work queued before the call is drained first and the call's own work is waited for, so the
    window holds this call's kernels only. Warm fn up first (lazy init, autotuning, compiles)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)  # SYNC: earlier work stays out of the window
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)  # SYNC: the call's kernels land inside the window
    kernels = [e for e in prof.events() if _is_kernel(e)]
    by_name: dict[str, tuple[int, float]] = {}
    for e in kernels:
        count, us = by_name.get(_short(e.name), (0, 0.0))
        by_name[_short(e.name)] = (count + 1, us + e.time_range.end - e.time_range.start)
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    return CallProfile(len(spans), union_us(spans), by_name)


def _short(name: str) -> str:
    """A kernel's name without its template arguments (C++ names run to hundreds of chars)."""
    return name.split("<", 1)[0].removeprefix("void ")[:80]


def kernels_per_call(fn: Callable[[], object], device: str | torch.device) -> int | None:
    """CUDA kernels one call of fn launches; None (fn not run) off CUDA."""
    p = profile_call(fn, device)
    return None if p is None else p.kernels


def _is_kernel(e) -> bool:
    """A device-side kernel event (not a copy, a memset or a GPU-side annotation range)."""
    if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
        return False
    return not e.name.startswith(NOT_KERNELS)


def union_us(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total
