"""A device-side append-only record buffer: debug checks write rows without a host sync."""

from __future__ import annotations

import torch
from torch import Tensor

FIELDS = ("step", "layer", "expert", "slot", "what")


class RecordBuffer:
    """rows [capacity + 1, 5] int64 (the last row is a sink) and a device counter."""

    def __init__(self, capacity: int, device: torch.device):
        self.rows = torch.zeros(capacity + 1, len(FIELDS), dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self._consts: dict[tuple[int, int], Tensor] = {}

    def add(self, bad: Tensor, step: int, layer: int, expert: Tensor, slot: Tensor,
            what: int) -> None:
        """Append one row per True in bad [n]; expert/slot [n]. Fixed shapes, no sync."""
        cap = self.rows.shape[0] - 1
        hit = bad.long()
        idx = torch.cumsum(hit, 0).add_(self.count - 1)  # [n] target rows
        idx = torch.where(bad & (idx < cap), idx, cap)
        n, dev = bad.shape[0], bad.device
        rec = torch.stack([torch.full((n,), step, device=dev), self._const(n, layer, dev),
                           expert.long(), slot.long(), self._const(n, what, dev)], dim=1)
        self.rows.index_copy_(0, idx, rec)
        self.count += hit.sum()

    def _const(self, n: int, value: int, device) -> Tensor:
        """[n] int64 of value, made once (the layer and kind columns repeat every step)."""
        key = (n, value)
        if key not in self._consts:
            self._consts[key] = torch.full((n,), value, dtype=torch.int64, device=device)
        return self._consts[key]

    def read(self) -> list[dict]:
        # SYNC: reading the records (at the end, or when the panel refreshes)
        n = min(int(self.count.item()), self.rows.shape[0] - 1)
        return [dict(zip(FIELDS, r)) for r in self.rows[:n].tolist()]
