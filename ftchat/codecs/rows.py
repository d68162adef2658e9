"""The packed per-expert row: what the host store and the slot cache hold (docs/model.md section 13).

bf16 row:  gate_up [2I, H] | down [H, I]                      (model dtype bytes)
NVFP4 row: gate_up packed [2I, H/2] u8 | gate_up scales [2I, H/16] e4m3 | gate_up globals [2I] f32
           | down packed [H, I/2] u8 | down scales [H, I/16] e4m3 | down globals [H] f32
Each part starts on a 128-byte boundary. Gate rows come first in gate_up, then up rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

ALIGN = 128


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Part:
    name: str
    offset: int  # bytes from the row start
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class RowLayout:
    """Byte layout of one routed expert. kind: 'bf16' (any float dtype) or 'nvfp4'."""

    kind: str
    hidden: int  # H
    inter: int  # I
    dtype: torch.dtype = torch.bfloat16  # element dtype of a dense row

    @cached_property
    def parts(self) -> tuple[Part, ...]:
        H, I = self.hidden, self.inter
        if self.kind == "nvfp4":
            specs = [
                ("gate_up", (2 * I, H // 2), torch.uint8),
                ("gate_up_scale", (2 * I, H // 16), torch.float8_e4m3fn),
                ("gate_up_global", (2 * I,), torch.float32),
                ("down", (H, I // 2), torch.uint8),
                ("down_scale", (H, I // 16), torch.float8_e4m3fn),
                ("down_global", (H,), torch.float32),
            ]
        else:
            specs = [("gate_up", (2 * I, H), self.dtype), ("down", (H, I), self.dtype)]
        out, off = [], 0
        for name, shape, dt in specs:
            p = Part(name, off, shape, dt)
            out.append(p)
            off = _align(off + p.nbytes)
        return tuple(out)

    @cached_property
    def nbytes(self) -> int:
        last = self.parts[-1]
        return _align(last.offset + last.nbytes)

    def pack(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pack named parts into one uint8 row [R]."""
        row = torch.zeros(self.nbytes, dtype=torch.uint8)
        for p in self.parts:
            t = tensors[p.name].to(p.dtype).contiguous().reshape(p.shape)
            row[p.offset : p.offset + p.nbytes] = t.view(-1).view(torch.uint8)
        return row

    def view(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        """View part `name` of rows [N, R] uint8 as [N, *shape] of its dtype (no copy)."""
        p = next(q for q in self.parts if q.name == name)
        return rows[:, p.offset : p.offset + p.nbytes].view(p.dtype).view(rows.shape[0], *p.shape)
