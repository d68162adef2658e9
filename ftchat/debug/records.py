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

    def add(self, bad: Tensor, step: Tensor | int, layer: int, expert: Tensor, slot: Tensor,
            what: int) -> None:
        """Append one row per True in bad [n]; expert/slot [n]. Fixed shapes, no sync."""
        cap = self.rows.shape[0] - 1
        idx = self.count + torch.cumsum(bad.long(), 0) - 1  # [n] target rows
        idx = torch.where(bad & (idx < cap), idx, cap)
        n = bad.shape[0]
        rec = torch.stack([
            torch.as_tensor(step, device=bad.device).expand(n).long(),
            torch.full((n,), layer, device=bad.device),
            expert.long(), slot.long(), torch.full((n,), what, device=bad.device),
        ], dim=1)
        self.rows.index_copy_(0, idx, rec)
        self.count += bad.long().sum()

    def read(self) -> list[dict]:
        # SYNC: reading the records (at the end, or when the panel refreshes)
        n = min(int(self.count.item()), self.rows.shape[0] - 1)
        return [dict(zip(FIELDS, r)) for r in self.rows[:n].tolist()]
