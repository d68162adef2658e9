"""The host store: every routed expert as one contiguous row, in one exact-size allocation.

On CUDA the allocation is registered as pinned memory (cudaHostRegister) after it is filled, so
the copy kernel can read it through its device alias (UVA). PyTorch's pinned allocator would round
70 GB up to 128 GB.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ftchat.model.checkpoint import Checkpoint
from ftchat.codecs.rows import RowLayout


def fill_host_rows(ckpt: Checkpoint, layout: RowLayout,
                   progress: Callable[[int, int], None] | None = None) -> Tensor:
    """rows [L*E, R] uint8 read layer by layer from the checkpoint."""
    a = ckpt.args
    E = a.num_experts
    rows = torch.empty(a.num_hidden_layers * E, layout.nbytes, dtype=torch.uint8)
    for layer, r in ckpt.iter_expert_rows(layout):
        rows[layer * E : (layer + 1) * E] = r
        if progress:
            progress(layer + 1, a.num_hidden_layers)
    return rows
