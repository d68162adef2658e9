"""Copy planned rows from a host store into a device bank: the Triton kernel and its torch twin.

A plan is src [M] int64 (host row), dst [M] int32 (bank row) and count [1] int32, all on the
bank's device; entries >= count are unused. bank is [S + 1, R] uint8: its last row is the sink
that masked copies may write. On CUDA the kernel reads pinned host rows through their device
alias (UVA) and never brings the count to the host; `copy_rows_ref` does the same with torch ops.
Legend: M plan entries, N host rows, S bank rows (sink apart), R row bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftchat.kernels import jit as _jit, tl

BLOCK_BYTES = 16384  # bytes a program moves per work item


def check_plan(host: Tensor, bank: Tensor, src: Tensor, dst: Tensor, count: Tensor) -> None:
    assert host.dtype == bank.dtype == torch.uint8, (host.dtype, bank.dtype)
    assert host.dim() == bank.dim() == 2, (host.shape, bank.shape)
    assert host.shape[1] == bank.shape[1], (host.shape, bank.shape)
    assert host.is_contiguous() and bank.is_contiguous()
    assert src.dtype == torch.int64 and dst.dtype == torch.int32 and count.dtype == torch.int32
    assert src.shape == dst.shape and src.dim() == 1 and count.shape == (1,)
    assert src.device == dst.device == count.device == bank.device


# ===== torch path: CPU, and the reference =====


def copy_rows_ref(host: Tensor, bank: Tensor, src: Tensor, dst: Tensor, count: Tensor) -> None:
    """bank[dst[i]] = host[src[i]] for i < count. Fixed shapes: entries >= count copy host row 0
    into the sink row S, so nothing here depends on the count's value on the host."""
    check_plan(host, bank, src, dst, count)
    live = torch.arange(src.shape[0], device=src.device) < count  # [M]
    rows_src = torch.where(live, src, torch.zeros_like(src))  # [M]
    rows_dst = torch.where(live, dst.long(), torch.full_like(src, bank.shape[0] - 1))  # [M]
    if host.device == bank.device:
        bank.index_copy_(0, rows_dst, host.index_select(0, rows_src))
        return
    # CUDA bank, host store in pinned memory, no Triton: one async copy per real entry.
    # SYNC: the plan crosses to the host (fallback only; not capturable in a CUDA graph)
    n = int(count.item())
    for s, d in zip(src[:n].tolist(), dst[:n].tolist()):
        bank[d].copy_(host[s], non_blocking=True)


# ===== Triton path: CUDA (and the interpreter in tests) =====


@_jit
def _copy_rows_kernel(host_ptr, bank_ptr, src_ptr, dst_ptr, count_ptr, M, ROW,
                      BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    # ROW: row length in elements of the pointers' type; one work item = (entry, block of a row)
    n = tl.minimum(tl.load(count_ptr), M)
    blocks = tl.cdiv(ROW, BLOCK)
    offs = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), n * blocks, PROGRAMS):
        e = item // blocks
        col = (item % blocks) * BLOCK + offs
        ok = col < ROW
        src = tl.load(src_ptr + e).to(tl.int64)
        dst = tl.load(dst_ptr + e).to(tl.int64)
        v = tl.load(host_ptr + src * ROW + col, mask=ok)
        tl.store(bank_ptr + dst * ROW + col, v, mask=ok)


def copy_rows_triton(host: Tensor, bank: Tensor, src: Tensor, dst: Tensor, count: Tensor,
                     programs: int, block_bytes: int = BLOCK_BYTES, num_warps: int = 4) -> None:
    """The Triton copy: `programs` programs (the caller's settings.copy_programs) loop over
    (entry, block) work items; rows are moved as int32 words (16-byte vector loads) when
    R % 4 == 0. Entries >= count are not touched."""
    check_plan(host, bank, src, dst, count)
    assert programs > 0 and block_bytes > 0 and block_bytes & (block_bytes - 1) == 0
    word = 4 if host.shape[1] % 4 == 0 else 1
    view = torch.int32 if word == 4 else torch.uint8
    _copy_rows_kernel[(programs,)](
        host.view(view), bank.view(view), src, dst, count, src.shape[0], host.shape[1] // word,
        BLOCK=max(block_bytes // word, 1), PROGRAMS=programs, num_warps=num_warps,
    )
