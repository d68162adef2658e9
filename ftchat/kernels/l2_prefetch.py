"""Weights pulled into L2 ahead of the kernel that reads them (`kernels.L2_PREFETCH`, off by
default until measured at 48 layers).

Why: at 48 layers a resident decode step moves ~125 MB of weights a layer in ~105 us, ~1.2 TB/s
of the H200's ~4.3: HBM idles while a kernel waits for the one before it (PDL), drains its last
programs, runs a last-arriver epilogue, or does latency-bound work (the GDN recurrence, the QSA
rank and attention, the router). A kernel whose next weights are known asks L2 for them first,
so they stream in during that idle time and the next kernel reads them from L2.

How: `cp.async.bulk.prefetch.L2.global` (sm_90+): one instruction hands the copy engine a
contiguous range (16-byte aligned, a multiple of 16 bytes); nothing comes back to registers and
nothing waits, so the issuing kernel goes on at once. The first `L2_PROGRAMS` programs of the
issuing kernel each take an equal share of the range (one wave: the requests start on many SMs
at once) and issue it as `L2_LANES` instructions from thread 0. A prefetch is only a hint: L2
is the GPU's point of coherence, so it can never make a load see stale data, and no result
changes with it on or off (the GPU tests compare tokens and logits bit for bit). The range is
capped (`L2_PREFETCH.value` MiB) so that prefetched lines are not evicted by other prefetched
lines before their reader runs (the H200's L2 is 50 MB).

Where (the issuing kernel -> what it prefetches):
  HC read kernel 1 -> its kernel 2's W_up (hyper.hc_mix_triton)
  HC read kernel 2 -> the block's first weight (the GDN / QSA input projection, the MoE GEMV;
    after the final mixer, lm_head)
  GDN recurrence -> out_proj; QSA prep -> o_proj (the latency-bound kernels before a GEMV)
  MoE fused GEMV -> the shared expert's down weight
  the shared down GEMV -> the routed experts' gate_up rows (`prefetch_rows`, after its wait:
    the router's slots are final then)
  routed kernel 1 -> the down rows of its experts (known once it has read the slot ids)
In the Triton interpreter and on CPU the instruction does not exist: `target` gives L2PF False
there and the kernels compile without it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON, INTERPRET, L2_PREFETCH, jit as _jit, tl

L2_PROGRAMS = 128  # programs of the issuing kernel that take part: one wave on 132 SMs
L2_LANES = 8  # bulk prefetch instructions a program issues
ALIGN = 16  # the instruction's address and size unit
_c = tl.constexpr if HAS_TRITON else int  # jit functions read module constants as constexprs
_PROGRAMS, _LANES, _ALIGN = _c(L2_PROGRAMS), _c(L2_LANES), _c(ALIGN)

_PTX = ("{ .reg .pred %pp; .reg .b32 %tt; mov.u32 %tt, %tid.x; setp.eq.u32 %pp, %tt, 0; "
        "setp.gt.and.s32 %pp, $2, 0, %pp; @%pp cp.async.bulk.prefetch.L2.global [$1], $2; "
        "mov.u32 $0, 0; }")
_PREFETCH_PTX = tl.constexpr(_PTX) if HAS_TRITON else _PTX  # a jit function reads constexprs


@_jit
def piece(nbytes, pid, n, i):
    """(start, size) of lane i of program pid of the n taking part: program pid owns the share
    [pid * share, (pid + 1) * share) of [0, nbytes) (share = nbytes / n rounded up to the unit),
    cut into L2_LANES pieces; size 0 past nbytes. Starts and sizes are multiples of 16 when
    nbytes is; the pieces of all programs and lanes tile [0, nbytes) once."""
    share = ((nbytes + n - 1) // n + _ALIGN - 1) // _ALIGN * _ALIGN
    step = ((share + _LANES - 1) // _LANES + _ALIGN - 1) // _ALIGN * _ALIGN
    p0 = pid.to(tl.int64) * share
    start = p0 + i * step
    size = tl.maximum(tl.minimum(tl.minimum(p0 + share, nbytes) - start, step), 0)
    return start, size


@_jit
def prefetch_l2(ptr, nbytes, pid, nprog, ON: tl.constexpr):
    """Program pid of nprog asks L2 for its share of the nbytes at ptr (ptr 16-byte aligned,
    nbytes a multiple of 16; the first L2_PROGRAMS programs take part, `piece`). ON False (a
    constexpr): compiles to nothing."""
    if ON:
        n = tl.minimum(nprog, _PROGRAMS)
        if pid < n:
            base = ptr.to(tl.pointer_type(tl.int8))
            for i in tl.static_range(_LANES):
                start, size = piece(nbytes, pid, n, i)
                tl.inline_asm_elementwise(_PREFETCH_PTX, "=r,l,r",
                                          [base + start, size.to(tl.int32)],
                                          dtype=tl.int32, is_pure=False, pack=1)


@_jit
def prefetch_rows(bank_ptr, slots_ptr, row_bytes, off, nbytes, pid, NROWS: tl.constexpr,
                  ON: tl.constexpr):
    """The first L2_PROGRAMS programs (by pid) ask L2 for [off, off + nbytes) of the NROWS bank
    rows at slots[0..NROWS) (int32 or int64; read here: call after the PDL wait), each row by
    L2_PROGRAMS // NROWS of them. ON False: compiles to nothing."""
    if ON:
        per = _PROGRAMS // NROWS
        part = pid // NROWS
        if part < per:
            slot = tl.load(slots_ptr + pid % NROWS).to(tl.int64)
            base = bank_ptr.to(tl.pointer_type(tl.int8)) + slot * row_bytes + off
            prefetch_l2(base, nbytes, part, per, True)


class Rows(NamedTuple):
    """Rows a kernel asks L2 for once it has read their slot ids: part [offset, offset + nbytes)
    of rows slots [T, K] of bank [S, R] uint8."""

    bank: Tensor
    slots: Tensor
    offset: int
    nbytes: int


def enabled(device: torch.device) -> bool:
    """Whether decode kernels on device prefetch: the switch on, a CUDA GPU of sm_90+ (the
    instruction's), not the interpreter."""
    return L2_PREFETCH.value > 0 and _has_instruction(device)


@functools.lru_cache(maxsize=None)
def _has_instruction(device: torch.device) -> bool:
    return (HAS_TRITON and not INTERPRET and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (9, 0))


def _capped(nbytes: int) -> int:
    # at most the switch's MiB, rounded down to the instruction's unit
    return min(nbytes, int(L2_PREFETCH.value) << 20) // ALIGN * ALIGN


def span(t: Tensor | None) -> int:
    """The bytes of t a kernel prefetches: its storage from its first element, capped, rounded
    down to the instruction's unit; 0 where nothing is prefetched (the switch off, no tensor,
    CPU, the interpreter, a start off the 16-byte grid, t not contiguous)."""
    if t is None or not enabled(t.device) or not t.is_contiguous() or t.data_ptr() % ALIGN:
        return 0
    return _capped(t.numel() * t.element_size())


def target(t: Tensor | None, like: Tensor) -> dict:
    """Launch arguments of a kernel's prefetch of t: pf_ptr, pf_bytes and the constexpr L2PF
    (False: the kernel compiles without it; pf_ptr is then `like`, never read)."""
    n = span(t)
    return dict(pf_ptr=t if n else like, pf_bytes=n, L2PF=n > 0)


def rows_target(bank: Tensor, offset: int, nbytes: int) -> dict:
    """Launch arguments of a kernel that prefetches a part of the bank rows it reads (found only
    once it has read their slot ids): the part's byte offset in a row pf_off, its bytes (capped,
    rounded down to the unit) pf_bytes, and L2PF. The bank and the offset must sit on the 16-byte
    grid (row layouts align parts to 128 bytes), else nothing is prefetched."""
    n = 0
    if enabled(bank.device) and bank.data_ptr() % ALIGN == 0 and offset % ALIGN == 0:
        n = _capped(nbytes)
    return dict(pf_off=offset, pf_bytes=n, L2PF=n > 0)


def rows_args(rows: Rows | None, like: Tensor) -> dict:
    """Launch arguments of `prefetch_rows` for rows (None, the switch off, too many rows for
    the programs, or a range off the 16-byte grid: L2ROWS False, the pointers `like`)."""
    if rows is not None:
        n = rows.slots.numel()
        t = rows_target(rows.bank, rows.offset, rows.nbytes)
        if t["L2PF"] and 0 < n <= L2_PROGRAMS and rows.slots.is_contiguous():
            return dict(pr_bank=rows.bank, pr_slots=rows.slots, pr_row=rows.bank.shape[1],
                        pr_off=rows.offset, pr_bytes=t["pf_bytes"], PR_N=n, L2ROWS=True)
    return dict(pr_bank=like, pr_slots=like, pr_row=0, pr_off=0, pr_bytes=0, PR_N=1,
                L2ROWS=False)
