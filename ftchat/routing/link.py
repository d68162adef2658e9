"""A model of offloaded decode time from counts (docs/routing.md 4): one copy link, the
compute stream waiting for each layer's demand copy.

Per layer l of a token: the compute stream first joins layer l's prefetch copy (issued one
layer up), then issues l's demand copy, which queues behind whatever the link still carries;
l's compute (T_compute / L) starts when that copy lands; l+1's prefetch copy is issued after
l's demand copy, on the same link, and runs under l's compute. The model ignores the copy
engine's per-copy latency and any overlap of a layer's attention with its copies, so it is a
bound on what scheduling can gain, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ftchat.offload.budget import bracket

PCIE5_GBPS = 52.0  # host-to-device, measured on the H200 machine (docs/performance.md)
PCIE4_GBPS = 26.0  # half of it: a PCIe-4 x16 slot


@dataclass(frozen=True)
class LinkModel:
    compute_s: float  # the resident decode step (every expert in VRAM), seconds per token
    link_gbps: float  # host-to-device bandwidth, GB/s
    row_bytes: int  # one expert row

    @property
    def row_s(self) -> float:
        return self.row_bytes / (self.link_gbps * 1e9)

    def token_seconds(self, misses: np.ndarray, installs: np.ndarray) -> float:
        """Mean seconds per token. misses, installs [tokens, L]: rows copied per layer (installs
        counted at the layer they were made for)."""
        n, L = misses.shape
        c, r = self.compute_s / L, self.row_s
        total = 0.0
        for m, p in zip(misses.tolist(), installs.tolist()):
            now = link = 0.0  # compute stream clock, link free from
            pref_done = 0.0
            for layer in range(L):
                now = max(now, pref_done)  # the join
                link = max(link, now) + m[layer] * r  # demand copy, behind the link's queue
                demand_done = link
                if layer + 1 < L:
                    link += p[layer + 1] * r  # next layer's prefetch, after this demand copy
                    pref_done = link
                now = demand_done + c
            total += now
        return total / n

    def bound_seconds(self, rows_per_token: float) -> float:
        """The overlap bound max(T_compute, T_link): everything overlapped, nothing waited for."""
        return max(self.compute_s, rows_per_token * self.row_s)

    def bracket(self, num_layers: int, cap: int) -> tuple[int, int]:
        """floor(r) and floor(r) + 1 (clamped to 0..cap), r the rows the link carries under one
        layer's compute: the two budgets `--budget auto` times (offload/budget.py)."""
        return bracket(self.compute_s, num_layers, self.row_s, cap)
