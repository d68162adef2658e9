"""The verifier (FREETOKEN_MOE_PREFETCH_VERIFY=meta|1, --verify meta|bytes).

meta:  before each routed expert kernel, every routed id's maps agree (slot_of -> slot,
       id_of[slot] -> id) and no copy that targets its slot is still in flight. Each copy stamps
       its completion on the device from its own stream, so a read that was not ordered after the
       copy sees a stale stamp.
bytes: also compares each routed slot's bytes with the host row before and after the kernel.
Violations are recorded on the device (step, layer, expert id, slot, what), never fixed. In a
batch, rows that route to one expert through one slot make one pair: a violation there is
recorded once, not once per row (the checks see the batch's pairs flattened, any number of rows).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftchat.debug.record_buffer import RecordBuffer
from ftchat.offload.hooks import BackendView, Hooks

MAP_MISMATCH, PENDING_COPY, BYTES_BEFORE, BYTES_AFTER = 1, 2, 3, 4
WHAT = {MAP_MISMATCH: "slot maps disagree", PENDING_COPY: "a copy into the slot is still in flight",
        BYTES_BEFORE: "slot bytes differ from the host row before the kernel",
        BYTES_AFTER: "slot bytes differ from the host row after the kernel"}
KINDS = ("demand", "prefetch")


class Verifier(Hooks):
    def __init__(self, mode: str, num_layers: int, device: torch.device, capacity: int = 4096):
        if mode not in ("meta", "bytes"):
            raise ValueError(mode)
        self.mode = mode
        self.records = RecordBuffer(capacity, device)
        # stamp[kind, layer] = 1 + step of the last completed copy (written on the copy's stream)
        self.stamp = torch.zeros(len(KINDS), num_layers, dtype=torch.int64, device=device)
        # (kind, layer) -> (the copy's live destinations [n] int64, unused -1; its step)
        self.issued: dict[tuple[str, int], tuple[torch.Tensor, int]] = {}

    def before_copy(self, v: BackendView, plan, layer: int, kind: str) -> None:
        # the plan's destinations, unused entries -1: computed once here, on the compute stream
        # that wrote the plan, instead of at every kernel that checks it
        live = torch.arange(plan.dst.shape[0], device=plan.dst.device) < plan.count
        self.issued[kind, layer] = (torch.where(live, plan.dst.long(), -1), v.step)

    def after_copy(self, v: BackendView, plan, layer: int, kind: str) -> None:
        self.stamp[KINDS.index(kind), layer] = v.step + 1

    def before_kernel(self, v: BackendView, p) -> None:
        if p.bank is not v.bank:  # prefill reads the host rows: nothing to check
            return
        gid, slot, first = _routed(v, p)
        bad = (v.maps.slot_of[gid].long() != slot) | (v.maps.id_of[slot].long() != gid)
        self.records.add(_once(bad, first), v.step, p.layer, gid, slot, MAP_MISMATCH)
        pending = None  # [T*K] the slot is a target of a copy the kernel must not overlap
        for (kind, layer), (dst, step) in self.issued.items():
            if layer < p.layer or step != v.step:
                continue
            targets = (slot[:, None] == dst[None]).any(1)
            if layer == p.layer:  # copies for this layer must be complete
                targets &= self.stamp[KINDS.index(kind), layer] != step + 1
            # copies for later layers must not touch it at all
            pending = targets if pending is None else pending | targets
        if pending is not None:
            self.records.add(_once(pending, first), v.step, p.layer, gid, slot, PENDING_COPY)
        if self.mode == "bytes":
            self._bytes(v, p, BYTES_BEFORE)

    def after_kernel(self, v: BackendView, p) -> None:
        if self.mode == "bytes" and p.bank is v.bank:
            self._bytes(v, p, BYTES_AFTER)

    def _bytes(self, v: BackendView, p, what: int) -> None:
        gid, slot, first = _routed(v, p)
        host = v.host_rows[gid.to(v.host_rows.device)].to(v.bank.device, non_blocking=True)
        self.records.add(_once((v.bank[slot] != host).any(-1), first), v.step, p.layer, gid,
                         slot, what)

    def report(self) -> list[dict]:
        return [{**r, "what": WHAT[r["what"]]} for r in self.records.read()]

    def figures(self) -> dict[str, int]:
        return {"verify_records": len(self.report())}


def _routed(v: BackendView, p) -> tuple[Tensor, Tensor, Tensor | None]:
    """The kernel's routed pairs flattened: global expert ids [T*K], their slots [T*K], and
    where T > 1 a mask [T*K] of each (id, slot) pair's first place (rows that share an expert
    repeat it; a row given another slot for it is a pair of its own); None for one token, whose
    top-k ids are distinct."""
    gid = p.ids.flatten() + p.layer * v.num_experts
    slot = p.slots.flatten().long()
    if p.ids.shape[0] == 1:
        return gid, slot, None
    same = (gid[:, None] == gid[None]) & (slot[:, None] == slot[None])  # [T*K, T*K]
    return gid, slot, ~same.tril(-1).any(1)  # no earlier place holds the same pair


def _once(bad: Tensor, first: Tensor | None) -> Tensor:
    return bad if first is None else bad & first
