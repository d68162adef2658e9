"""The token embedding [V, D]: on the device, or (CUDA) in pinned host memory, read over UVA.

A decode step reads one row per token, 5 KiB of a 1.27 GB table at the real geometry: the table
need not take VRAM. On CUDA with Triton the loaders keep it in host memory, page-locked, and the
lookup is the PLE gather kernel with one head (ftchat/kernels/ple_gather.py): no host sync, so
the step stays inside the CUDA graph, and the values are the table's bits. Elsewhere (CPU, or no
Triton) the table sits where the other weights do and the lookup is plain indexing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftchat.host_memory import pin
from ftchat.kernels import HAS_TRITON, ple_gather
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.model.ngram_table import page_tensor

EMBED = "embed_tokens.weight"


def host_placement(device: torch.device | str) -> bool:
    """Whether the loaders keep the embedding in host memory for `device`: CUDA with Triton."""
    return torch.device(device).type == "cuda" and HAS_TRITON


_PINNED: list[Tensor] = []  # every host table made, kept for the process (see to_host)


def to_host(table: Tensor) -> Tensor:
    """The table in page-locked host memory (the gather kernel reads it over UVA), on pages of
    its own and registered at its size (torch's pin_memory would round 1.27 GB up to 2 GiB).
    The copy lives as long as the process, so no captured graph can outlive the table whose
    address it holds."""
    host = page_tensor(tuple(table.shape), table.dtype)
    host.copy_(table)
    pin(host)
    _PINNED.append(host)
    return host


def embed(table: Tensor, tokens: Tensor, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """Rows of table [V, D] at tokens [...] -> [..., D] on tokens' device, table's dtype. A host
    table (pinned, `to_host`) can only be read by the gather kernel: it runs whatever kc.fused
    says (kc gives its launch options)."""
    if table.device == tokens.device:
        return table[tokens]
    assert tokens.is_cuda and table.is_pinned(), "a host embedding needs CUDA tokens, pinned"
    return ple_gather.gather_triton(table, None, tokens[..., None].long(), table.dtype, kc=kc)
