"""Copy planned expert rows from the host store into the GPU slot bank (docs/design.md section 5).

A plan is src [M] int64 (host row = global expert id), dst [M] int32 (slot) and count [1] int32,
all on the bank's device; entries >= count are unused (they point at the sinks: src N, dst S).
The copies themselves are ftchat/kernels/row_copy.py's: its Triton kernel on CUDA, its torch
twin on CPU (or without Triton).
Legend: M plan entries, N host rows, S slots, R row bytes.
"""

from __future__ import annotations

from torch import Tensor

from ftchat.kernels import HAS_TRITON
from ftchat.kernels.row_copy import copy_rows_ref, copy_rows_triton
from ftchat.settings import DEFAULT_COPY_PROGRAMS


def copy_rows(host: Tensor, bank: Tensor, src: Tensor, dst: Tensor, count: Tensor,
              programs: int = DEFAULT_COPY_PROGRAMS) -> None:
    """Carry out a copy plan: bank[dst[i]] = host[src[i]] for i < count.

    Args:
        host: [N, R] uint8 host store (pinned on CUDA).
        bank: [S + 1, R] uint8 slot bank; row S is the sink.
        src, dst, count: the plan ([M] int64, [M] int32, [1] int32) on the bank's device.
        programs: Triton programs on CUDA (settings.copy_programs); 0 picks the torch path.
    """
    if bank.is_cuda and programs > 0 and HAS_TRITON:
        copy_rows_triton(host, bank, src, dst, count, programs)
    else:
        copy_rows_ref(host, bank, src, dst, count)
