"""The host store: every routed expert as one contiguous row, in one exact-size allocation.

On CUDA the allocation is registered as pinned memory (cudaHostRegister) after it is filled, so
the copy kernel can read it through its device alias (UVA). PyTorch's pinned allocator would round
70 GB up to 128 GB.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from ftchat.errors import FtchatError
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


def pin(rows: Tensor) -> None:
    """Register rows' memory as page-locked and mapped (exact size), until rows is collected.

    The registration must end before the memory is freed: the driver keys it by address, and a
    later allocation at the same addresses (the next model a process loads) would inherit a
    stale entry, and its copies fail ("invalid argument") or its own registration be refused."""
    nbytes = rows.numel() * rows.element_size()
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(rows.data_ptr(), nbytes, 0)
    if int(rc) != 0:
        raise FtchatError(
            f"cudaHostRegister refused to pin {nbytes / 2**30:.1f} GiB of host memory (error "
            f"{int(rc)}); raise the locked-memory limit (ulimit -l) or free host memory")
    # a tensor's weak references are cleared before it drops its storage: unregister, then free;
    # not at exit, where the process's end releases it (48 GiB would take seconds to unlock)
    weakref.finalize(rows, cudart.cudaHostUnregister, rows.data_ptr()).atexit = False
