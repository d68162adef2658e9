"""`--record-routing FILE`: per decode token and layer, the routed expert ids and the router
lookahead's candidates for the next layer (computed from this layer's router input).

One JSON line per decode step: {"step": n, "routed": [[ids of layer 0], ...],
"candidates": [[top-K of layer 1 predicted at layer 0], ...]} (bs 1: the first sequence).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ftchat.offload.hooks import Hooks


class RoutingRecorder(Hooks):
    def __init__(self, path: str | Path, routers: list[torch.Tensor], k: int = 16):
        self.file = open(path, "w", buffering=1)  # line-buffered: complete lines on disk
        self.routers, self.k = routers, k
        self.routed: list[list[int]] = []
        self.cands: list[list[int]] = []

    def before_kernel(self, b, p) -> None:
        ids = p.ids[0].tolist()  # SYNC: recording only
        self.routed.append(ids)
        if p.layer + 1 < len(self.routers):
            x = getattr(p, "x", None)
            if x is not None:
                probs = torch.softmax(x[:1].float() @ self.routers[p.layer + 1].float().T, -1)
                self.cands.append(probs[0].topk(self.k).indices.tolist())

    def end_step(self, b) -> None:
        self.file.write(json.dumps({"step": b.step, "routed": self.routed,
                                    "candidates": self.cands}) + "\n")
        self.routed, self.cands = [], []

    def close(self) -> None:
        self.file.close()
