"""`--record-routing FILE`: per decode token and layer, the routed expert ids, the router
lookahead's candidates for the next layer, exactly as the backend computed them for prefetch,
and the router logits (what eviction `score` reads, so a replay of the trace can run it).

One JSON line per decode step: {"step": n, "routed": [[ids of layer 0], ...],
"candidates": [[top-C of layer 1 predicted at layer 0], ...], "logits_f16": "..."}. Routed ids
and logits are the first sequence's; the candidates are the batch's (the lookahead sums the
rows' probabilities). logits_f16 is base64 of the little-endian float16 array [L, E] (row
major): 2 bytes a logit keep a 48-layer, 512-expert step near 65 KB of text.
The file is written under a temporary name beside FILE and renamed to FILE when the run ends
(`OutputFile`); a run that fails or is stopped by a signal leaves FILE as it was.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ftchat.offload.hooks import BackendView, Hooks
from ftchat.output_file import OutputFile
from ftchat.routing.trace import trace_line


class RoutingRecorder(Hooks):
    reads_candidates = True  # the backend runs its lookahead even with prefetch off

    def __init__(self, path: str | Path, num_layers: int, force: bool = False):
        self.file = OutputFile(path, "--record-routing", force)  # line-buffered
        self.num_layers = num_layers
        self.routed: list[list[int]] = []
        self.cands: list[list[int]] = []
        self.logits: list[torch.Tensor] = []  # [E] float16 a layer (CPU)

    def before_kernel(self, v: BackendView, p) -> None:
        self.routed.append(p.ids[0].tolist())  # SYNC: recording only
        self.logits.append(v.router_logits(p.layer)[0].to("cpu", torch.float16))
        if p.layer + 1 < self.num_layers:
            self.cands.append(v.candidates(p.layer + 1).tolist())

    def end_step(self, v: BackendView) -> None:
        self.file.write(trace_line(v.step, self.routed, self.cands,
                                   torch.stack(self.logits).numpy()))
        self.routed, self.cands, self.logits = [], [], []

    def close(self) -> None:
        self.file.commit()

    def discard(self) -> None:
        self.file.discard()
