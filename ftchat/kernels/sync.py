"""Hand-offs: inside one launch ("the last program to arrive finishes") and between launches (PDL).

A split reduction writes partials, then each program bumps a counter; the one that sees n - 1
sums the partials in a fixed order (deterministic, unlike float atomics) and resets the counter,
so every launch leaves it zero. Its loads of the other programs' partials must bypass L1
(`cache_modifier=".cg"`).

Programmatic dependent launch (`ftchat.kernels.pdl_launch`): a kernel launched with it calls
`pdl_release` first (the next kernel may then be scheduled as this one's programs drain) and
`pdl_wait` in every program, unconditionally, before it reads anything an earlier kernel wrote or
writes anything at all (an earlier kernel may still read a buffer the allocator handed on). After
the wait every earlier kernel of the stream has finished: each PDL kernel waits before it ends, so
the chain holds. What comes before the wait may only read data no kernel writes (weights).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftchat.kernels import gdc_launch_dependents, gdc_wait, jit as _jit, tl


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


@_jit
def pdl_wait(PDL: tl.constexpr):
    # PDL: wait until the stream's previous kernel has finished and its writes are visible
    if PDL:
        gdc_wait()


@_jit
def pdl_release(PDL: tl.constexpr):
    # PDL: let the stream's next kernel be scheduled once every program of this one has run this
    if PDL:
        gdc_launch_dependents()
