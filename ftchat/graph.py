"""The whole decode step (model, slot-cache logic, copies) captured in one CUDA graph.

Replay is: copy into the static slices -> replay -> read the static logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class DecodeGraph:
    """One captured decode step for a fixed batch size. `step` runs the model on the static
    buffers; capturing executes it twice first (warm-up): the caller undoes what those steps did."""

    def __init__(self, step: Callable[[Tensor, Tensor], Tensor], batch: int, device: torch.device):
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [B, 1]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: Triton compiles, cuBLAS workspaces, allocator pools
                step(self.tokens, self.pos)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step(self.tokens, self.pos)  # [B, V]

    def __call__(self, tokens: Tensor, lengths: list[int]) -> Tensor:
        self.tokens.copy_(tokens, non_blocking=True)
        self.pos.copy_(torch.tensor(lengths, dtype=torch.long)[:, None], non_blocking=True)
        self.graph.replay()
        return self.logits
