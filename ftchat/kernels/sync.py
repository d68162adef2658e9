"""Cross-program hand-off inside one kernel launch: "the last program to arrive finishes".

A split reduction writes partials, then each program bumps a counter; the one that sees n - 1
sums the partials in a fixed order (deterministic, unlike float atomics) and resets the counter,
so every launch leaves it zero. Its loads of the other programs' partials must bypass L1
(`cache_modifier=".cg"`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftchat.kernels import jit as _jit, tl


@_jit
def last_to_arrive(cnt, n: tl.constexpr):
    # whether this program is the last of the n sharing counter cnt; the barrier first makes the
    # CTA's earlier stores happen before thread 0's release (acq_rel) atomic
    if n == 1:
        last = True
    else:
        tl.debug_barrier()
        last = tl.atomic_add(cnt, 1, sem="acq_rel") == n - 1
    return last


_COUNTERS: dict[tuple[torch.device, int, str], Tensor] = {}


def counters(device: torch.device, n: int, user: str) -> Tensor:
    """[n] int32 zeros for `user`'s kernels: one buffer per (device, size, user), never freed (a
    captured graph keeps its address). Users that may run on two streams at once take
    different names."""
    key = (torch.device(device), n, user)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _COUNTERS[key]
