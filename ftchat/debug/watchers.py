"""The debug watchers the settings turn on (`hooks_for`), chained in order (`HookChain`)."""

from __future__ import annotations

from ftchat.debug.routing_record import RoutingRecorder
from ftchat.debug.slot_audit import SlotAudit
from ftchat.debug.verifier import Verifier
from ftchat.offload.hooks import Hooks
from ftchat.settings import Settings


class HookChain(Hooks):
    """Several hooks in order (e.g. verifier and audit together)."""

    def __init__(self, hooks: list[Hooks]):
        self.hooks = hooks
        writers = [h.on_map_write for h in hooks if h.on_map_write is not None]
        self.on_map_write = (lambda name: [w(name) for w in writers]) if writers else None
        self.reads_candidates = any(h.reads_candidates for h in hooks)

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

    def figures(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self.hooks:
            out.update(h.figures())
        return out

    def close(self) -> None:
        for h in self.hooks:
            h.close()

    def discard(self) -> None:
        for h in self.hooks:
            h.discard()


def hooks_for(settings: Settings, num_layers: int, num_slots: int, device) -> Hooks | None:
    """The verifier, slot audit and routing recorder the settings ask for (None: all off)."""
    hooks: list[Hooks] = []
    if settings.verify:
        hooks.append(Verifier(settings.verify, num_layers, device))
    if settings.audit_every:
        hooks.append(SlotAudit(settings.audit_every, num_slots, device))
    if settings.record_routing:
        hooks.append(RoutingRecorder(settings.record_routing, num_layers, settings.force))
    return None if not hooks else hooks[0] if len(hooks) == 1 else HookChain(hooks)

