"""`--record-routing FILE`: per decode token and layer, the routed expert ids and the router
lookahead's candidates for the next layer, exactly as the backend computed them for prefetch.

One JSON line per decode step: {"step": n, "routed": [[ids of layer 0], ...],
"candidates": [[top-C of layer 1 predicted at layer 0], ...]}. Routed ids are the first
sequence's; the candidates are the batch's (the lookahead sums the rows' probabilities).
"""

from __future__ import annotations

import json
from pathlib import Path

from ftchat.offload.hooks import BackendView, Hooks


class RoutingRecorder(Hooks):
    reads_candidates = True  # the backend runs its lookahead even with prefetch off

    def __init__(self, path: str | Path, num_layers: int):
        self.file = open(path, "w", buffering=1)  # line-buffered: complete lines on disk
        self.num_layers = num_layers
        self.routed: list[list[int]] = []
        self.cands: list[list[int]] = []

    def before_kernel(self, v: BackendView, p) -> None:
        self.routed.append(p.ids[0].tolist())  # SYNC: recording only
        if p.layer + 1 < self.num_layers:
            self.cands.append(v.candidates(p.layer + 1).tolist())

    def end_step(self, v: BackendView) -> None:
        self.file.write(json.dumps({"step": v.step, "routed": self.routed,
                                    "candidates": self.cands}) + "\n")
        self.routed, self.cands = [], []

    def close(self) -> None:
        self.file.close()
