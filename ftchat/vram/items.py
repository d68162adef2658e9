"""What a VRAM plan is made of: the workload it is for, its items, the plan.

Exact items are dtype x shape of the tensors the loader, the decode state and the offload backend
create (tests/test_vram_plan.py checks them against real allocations of a tiny model). Estimates
(activations, workspaces, CUDA graph pools, the allocator's slack) say so and give their formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ftchat.sizes import PREFILL_CHUNK

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class Workload:
    """What a run allocates besides the weights; every field changes some item."""

    context: int  # KV capacity per sequence (L)
    decoders: tuple[int, ...] = (1,)  # rows of each decode state alive together
    banks: tuple[int | None, ...] = (None,)  # slot banks alive together; None: sized to fit
    prefill_tokens: int = PREFILL_CHUNK  # tokens of one prefill call (T; bench prefills 1)
    cuda: bool = True  # the prefill staging area and cuBLAS workspaces exist on CUDA only
    graphs: bool = True  # one CUDA graph (and its private pool) per decoder
    resident_rows: bool = False  # every expert row on the device too (bench's resident arms)
    candidates: int = 16  # router-lookahead top-C (the backend's cands buffer)
    dense_nvfp4: bool = False  # the GDN qkv / z kept in NVFP4 (an NVFP4 checkpoint stores them so)
    kv_cache_dtype: str = "auto"  # K/V storage: auto (the model dtype) or fp8 (codes + scales)

    @property
    def batch(self) -> int:
        return max(self.decoders)


@dataclass(frozen=True)
class Item:
    """One allocation, or a group of alike ones. grows: what makes it smaller (the advice of a
    refusal): "context", "slots", or "" (only a larger budget helps). dense: a dense weight (the
    model's size: neither fewer slots nor a shorter context shrinks it)."""

    name: str
    nbytes: int
    note: str
    exact: bool = True
    grows: str = ""
    dense: bool = False


@dataclass(frozen=True)
class VramPlan:
    items: tuple[Item, ...]  # in allocation order; the slot bank last
    slots: int  # slots of each bank sized to fit (or of every bank when all are given)
    row_bytes: int  # one expert row as the slot bank stores it
    total_experts: int  # N
    need: int  # the fewest slots a bank may have: batch x top-k

    @property
    def total(self) -> int:
        return sum(i.nbytes for i in self.items)

    def dense_bytes(self) -> int:
        return sum(i.nbytes for i in self.items if i.dense)


def human(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def gib_up(n: int) -> str:
    """A budget in GiB that holds n bytes (rounded up: it is a value to pass)."""
    return f"{math.ceil(n / GIB * 100) / 100:.2f} GiB"
