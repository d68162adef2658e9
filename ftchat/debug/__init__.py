"""Debug modes: the verifier, the slot audit, and how they attach to the offload backend."""

from __future__ import annotations

from ftchat.offload.hooks import Hooks


class HookChain(Hooks):
    """Several hooks in order (e.g. verifier and audit together)."""

    def __init__(self, hooks: list[Hooks]):
        self.hooks = hooks
        writers = [h.on_map_write for h in hooks if h.on_map_write is not None]
        self.on_map_write = (lambda name: [w(name) for w in writers]) if writers else None

    def before_copy(self, *a) -> None:
        for h in self.hooks:
            h.before_copy(*a)

    def after_copy(self, *a) -> None:
        for h in self.hooks:
            h.after_copy(*a)

    def before_kernel(self, *a) -> None:
        for h in self.hooks:
            h.before_kernel(*a)

    def after_kernel(self, *a) -> None:
        for h in self.hooks:
            h.after_kernel(*a)

    def end_step(self, *a) -> None:
        for h in self.hooks:
            h.end_step(*a)
