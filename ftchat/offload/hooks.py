"""Narrow callbacks through which the debug modes (ftchat.debug) watch the offload backend.

The default Hooks do nothing and launch nothing, so with debug modes off the decode step runs
exactly the same kernels. Hooks see the backend through a BackendView: what they may read, never
the backend itself.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from ftchat.offload.cache import SlotMaps
from ftchat.offload.streams import CpuStreams, CudaStreams


class ViewedBackend(Protocol):
    """What a BackendView reads of the backend (offload/backend.py `OffloadExperts`)."""

    maps: SlotMaps
    bank: Tensor
    host: Tensor
    num_experts: int
    step: int
    streams: CpuStreams | CudaStreams

    def candidates(self, layer: int) -> Tensor: ...

    def step_logits(self, layer: int) -> Tensor: ...


class BackendView:
    """The read-only face of an OffloadExperts that hooks receive."""

    def __init__(self, backend: ViewedBackend):
        self._b = backend

    @property
    def maps(self) -> SlotMaps:
        return self._b.maps

    @property
    def bank(self) -> Tensor:
        """[S+1, R] uint8 slot bank (the last row is the copy sink)."""
        return self._b.bank

    @property
    def host_rows(self) -> Tensor:
        """[L*E, R] uint8, every routed expert; row = global expert id."""
        return self._b.host

    @property
    def num_experts(self) -> int:
        return self._b.num_experts

    @property
    def step(self) -> int:
        """Decode steps completed so far."""
        return self._b.step

    @property
    def stream(self) -> str:
        """The stream whose work is being issued (or, on the CPU emulation, running) now."""
        return self._b.streams.current

    def candidates(self, layer: int) -> Tensor:
        """The router lookahead's candidates [C] for `layer`, as prefetch uses them (the
        compute stream waits for them). Only when a hook sets `reads_candidates`."""
        return self._b.candidates(layer)

    def router_logits(self, layer: int) -> Tensor:
        """Layer's router logits [T, E] fp32 on this step's input, during its MoE block (between
        `begin` and the end of `finish`). Computed for the caller: a GEMV, no map read."""
        return self._b.step_logits(layer)


class Hooks:
    on_map_write = None  # callable(name) before every slot-map write, or None (zero cost)
    reads_candidates = False  # True: the backend runs the router lookahead even without prefetch

    def before_copy(self, view: BackendView, plan, layer: int, kind: str) -> None:
        """A copy of `plan` (kind 'demand' or 'prefetch') is being issued (compute side)."""

    def after_copy(self, view: BackendView, plan, layer: int, kind: str) -> None:
        """The copy of `plan` has run, on the copy's own stream."""

    def before_kernel(self, view: BackendView, pending) -> None:
        """The routed expert kernel of pending.layer is about to read pending.slots."""

    def after_kernel(self, view: BackendView, pending) -> None:
        """The routed expert kernel of pending.layer has been issued."""

    def end_step(self, view: BackendView) -> None:
        """One decode step is complete."""

    def figures(self) -> dict[str, int]:
        """The hook's own findings for stats() (e.g. records, audits)."""
        return {}

    def close(self) -> None:
        """Release what the hook opened (files; a result file is renamed into place)."""

    def discard(self) -> None:
        """The run failed or was stopped: drop the hook's unfinished output (before `close`)."""
