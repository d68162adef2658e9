"""`--record-routing FILE`: per decode token and layer, the routed expert ids and the router
lookahead's candidates for the next layer, exactly as the backend computed them for prefetch.

One JSON line per decode step: {"step": n, "routed": [[ids of layer 0], ...],
"candidates": [[top-C of layer 1 predicted at layer 0], ...]}. Routed ids are the first
sequence's; the candidates are the batch's (the lookahead sums the rows' probabilities).
The file is written under a temporary name beside FILE and renamed to FILE when the run ends
(`OutputFile`); a run that fails or is stopped by a signal leaves FILE as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

from ftchat.offload.hooks import BackendView, Hooks
from ftchat.output_file import OutputFile


class RoutingRecorder(Hooks):
    reads_candidates = True  # the backend runs its lookahead even with prefetch off

    def __init__(self, path: str | Path, num_layers: int, force: bool = False):
        self.file = OutputFile(path, "--record-routing", force)  # line-buffered
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
        self.file.commit()

    def discard(self) -> None:
        self.file.discard()
