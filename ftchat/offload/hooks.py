"""Narrow callbacks through which the debug modes (ftchat.debug) watch the offload backend.

The default Hooks do nothing and launch nothing, so with debug modes off the decode step runs
exactly the same kernels.
"""

from __future__ import annotations


class Hooks:
    on_map_write = None  # callable(name) before every slot-map write, or None (zero cost)

    def before_copy(self, backend, plan, layer: int, kind: str) -> None:
        """A copy of `plan` (kind 'demand' or 'prefetch') is being issued (compute side)."""

    def after_copy(self, backend, plan, layer: int, kind: str) -> None:
        """The copy of `plan` has run, on the copy's own stream."""

    def before_kernel(self, backend, pending) -> None:
        """The routed expert kernel of pending.layer is about to read pending.slots."""

    def after_kernel(self, backend, pending) -> None:
        """The routed expert kernel of pending.layer has been issued."""

    def end_step(self, backend) -> None:
        """One decode step is complete."""
