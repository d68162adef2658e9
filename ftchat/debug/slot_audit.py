"""The slot audit (--audit-every N, env FREETOKEN_MOE_SLOT_AUDIT=N).

Keeps the last writer of every slot (stream, layer, step, kind), written from the copy's own
stream, and every N decode steps byte-checks every held slot against its host row. A bad slot is
reported with its last writer.
"""

from __future__ import annotations

import torch

from ftchat.offload.hooks import BackendView, Hooks
from ftchat.offload.streams import NAMES as STREAMS

KINDS = ("demand", "prefetch")


class SlotAudit(Hooks):
    def __init__(self, every: int, num_slots: int, device: torch.device):
        if every < 1:
            raise ValueError("audit interval must be >= 1")
        self.every = every
        # writers[slot] = (stream, layer, step, kind) of the last copy into it; -1 = never written
        self.writers = torch.full((num_slots + 1, 4), -1, dtype=torch.int64, device=device)
        self.audits = 0
        self.bad: list[dict] = []

    def after_copy(self, v: BackendView, plan, layer: int, kind: str) -> None:
        live = torch.arange(plan.dst.shape[0], device=plan.dst.device) < plan.count
        dst = torch.where(live, plan.dst.long(), self.writers.shape[0] - 1)  # masked -> sink row
        who = torch.tensor([STREAMS.index(v.stream), layer, v.step, KINDS.index(kind)],
                           device=self.writers.device)
        self.writers.index_copy_(0, dst, who.expand(dst.shape[0], 4))

    def end_step(self, v: BackendView) -> None:
        if v.step % self.every == 0:
            self.audit(v)

    def audit(self, v: BackendView) -> None:
        """Byte-check every held slot. SYNC: debug only, every N steps."""
        S = v.bank.shape[0] - 1
        held = v.maps.id_of[:S].long()
        slots = (held >= 0).nonzero().squeeze(1)
        ids = held[slots]
        host = v.host_rows[ids.to(v.host_rows.device)].to(v.bank.device)
        bad = (v.bank[slots] != host).any(-1)
        for s, e in zip(slots[bad].tolist(), ids[bad].tolist()):
            w = self.writers[s].tolist()
            self.bad.append({"step": v.step, "slot": s, "expert": e,
                             "writer": None if w[0] < 0 else {
                                 "stream": STREAMS[w[0]], "layer": w[1], "step": w[2],
                                 "kind": KINDS[w[3]]}})
        self.audits += 1

    def figures(self) -> dict[str, int]:
        return {"audits": self.audits, "audit_bad_slots": len(self.bad)}
