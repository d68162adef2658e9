"""Page-locked host memory registered at its exact size (cudaHostRegister), so kernels read it
over UVA and the host-to-device link copies from it at full speed. A leaf: the model (the host
embedding, the n-gram table) and the offload store (the expert rows) both pin with it."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ftchat.errors import FtchatError


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
