"""PLE n-gram rows gathered from the host-resident table: one Triton kernel (docs/model.md 7.4).

The real table [N, d] (N = 320 001 536, d = 160; fp8 e4m3 with one scalar scale, 47.7 GiB) lives
in one pinned host tensor (ftchat.model.ngram_table.HostTable). A decode token needs nh = 16 of
its rows (2.5 KiB in fp8): the kernel reads them through the table's device alias (UVA), the
rows come from `ngram_rows` on the device, and nothing goes to the host, so the whole decode step
(PLE included) is captured in the CUDA graph.

Dequantisation, the reference's (`dequantize`) and the kernel's, per value: the stored value to
fp32 (exact: fp8/bf16/f16 are subsets of fp32); times the scale as an fp32 multiply, rounded to
nearest even (exact when the scale has <= 20 significant bits, e.g. a bf16 or power-of-two scale;
an fp32 scale such as amax/448 rounds once here); then rounded to the model dtype (to nearest
even; exact for fp32). Two roundings at most, the same two on both sides, so the kernel equals
the torch path bit for bit. The bf16 rounding is done in bits (`_rnd`), because the interpreter's
cast truncates. The fp8 NaN codes (0x7F, 0xFF) are not part of the contract (the interpreter
decodes them as numbers); a table holds none.

Legend: n tokens (B*T), nh hash heads, d row width, N table rows; NHP, BLOCK_D powers of two.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON, jit as _jit, pdl_launch, tl, triton  # noqa: F401
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.sync import pdl_release, pdl_wait
from ftchat.kernels.hyper import _bf16, _rnd

OUT_DTYPES = (torch.bfloat16, torch.float32)  # the kernel's model dtypes (as the other kernels)


# ===== torch path: CPU, and the reference =====


def dequantize(raw: Tensor, scale: float | None, dtype: torch.dtype) -> Tensor:
    """Stored table values [..] (fp8 e4m3, bf16, f16, f32) -> dtype: to fp32, times the fp32
    scale if any (one fp32 rounding), then one rounding to dtype (module docstring)."""
    v = raw.float()
    if scale is not None:
        v = v * scale  # fp32 x fp32: torch multiplies a float tensor by a Python float in fp32
    return v.to(dtype)


def gather_ref(table: Tensor, scale: float | None, rows: Tensor, dtype: torch.dtype) -> Tensor:
    """E [..., nh*d] in dtype on rows' device: table [N, d] rows `rows` [..., nh], dequantized.
    A host table with device rows costs a host sync (rows to the host): eager only."""
    # SYNC: device rows go to the host table's memory (fallback: no Triton, or fused kernels off)
    got = table[rows.to(table.device)]  # [..., nh, d] stored dtype
    return dequantize(got, scale, dtype).to(rows.device).flatten(-2)


# ===== Triton path: CUDA (and the interpreter in tests) =====


@_jit
def _gather_kernel(table_ptr, rows_ptr, out_ptr, scale, NH: tl.constexpr, D: tl.constexpr,
                   NHP: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SCALE: tl.constexpr,
                   BF16: tl.constexpr, PDL: tl.constexpr):
    """Grid (n,): program t reads rows[t, :] [nh] int64 and the nh table rows [nh, d] (pinned
    host memory over UVA on CUDA), writes out[t, j*d + c] = round(fp32(table[row_j, c]) * scale).
    Row offsets are int64 (N*d is 51 G elements)."""
    pdl_release(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, NHP)  # [NHP] heads
    c = tl.arange(0, BLOCK_D)  # [BLOCK_D] columns
    h_ok = h < NH
    row = tl.load(rows_ptr + t * NH + h, mask=h_ok, other=0)  # [NHP] int64
    ok = h_ok[:, None] & (c[None, :] < D)  # [NHP, BLOCK_D]
    v = tl.load(table_ptr + row[:, None] * D + c[None, :], mask=ok).to(tl.float32)
    if HAS_SCALE:
        v = v * scale  # fp32 multiply, round to nearest even (no add: nothing to contract)
    v = _rnd(v, BF16)  # the model dtype's rounding, in bits; the store's cast is then exact
    tl.store(out_ptr + t * (NH * D) + h[:, None] * D + c[None, :], v.to(out_ptr.dtype.element_ty),
             mask=ok)


def gather_triton(table: Tensor, scale: float | None, rows: Tensor, dtype: torch.dtype, *,
                  kc: KernelConfig = DEFAULT) -> Tensor:
    """`gather_ref` in one kernel: no host sync, shapes fixed by rows' (graph-capturable).

    Args:
        table: [N, d] fp8 e4m3 / bf16 / f16 / f32; pinned host memory (cudaHostRegister) on
            CUDA, or on rows' device (the interpreter: the CPU).
        scale: the table's scalar scale (an fp32 value) or None.
        rows: [..., nh] int64 on the device, every value in [0, N) (Checkpoint checks the hash
            buffers against N at load, docs/model.md 7.1: row_j = mixed mod P_j + offset_j).
        dtype: the model dtype, bf16 or fp32.
    """
    assert dtype in OUT_DTYPES and rows.dtype == torch.int64, (dtype, rows.dtype)
    assert table.dim() == 2 and table.is_contiguous(), table.shape
    nh, d = rows.shape[-1], table.shape[1]
    flat = rows.reshape(-1, nh).contiguous()  # [n, nh]
    out = torch.empty(*rows.shape[:-1], nh * d, dtype=dtype, device=rows.device)  # [..., nh*d]
    if flat.shape[0] == 0:
        return out
    _gather_kernel[(flat.shape[0],)](
        table, flat, out, 1.0 if scale is None else scale, NH=nh, D=d,
        NHP=max(2, triton.next_power_of_2(nh)), BLOCK_D=max(2, triton.next_power_of_2(d)),
        HAS_SCALE=scale is not None, BF16=_bf16(dtype), num_warps=4, enable_fp_fusion=False,
        **pdl_launch(flat, kc.pdl))
    return out


# ===== dispatch =====


def fused(table: Tensor, rows: Tensor, dtype: torch.dtype, kc: KernelConfig = DEFAULT) -> bool:
    """Whether `gather` runs the kernel: fused kernels on rows' device (CUDA + Triton,
    KernelConfig.runs_fused), a model dtype it writes, and a table it can address (pinned host
    memory, or on rows' device)."""
    if not (kc.runs_fused(rows) and dtype in OUT_DTYPES):
        return False
    return table.device == rows.device or (rows.is_cuda and table.is_pinned())


def gather(table: Tensor, scale: float | None, rows: Tensor, dtype: torch.dtype, *,
           kc: KernelConfig = DEFAULT) -> Tensor:
    """E [..., nh*d] in dtype on rows' device from table [N, d] at rows [..., nh]: the kernel when
    `fused`, else the torch reference."""
    if fused(table, rows, dtype, kc):
        return gather_triton(table, scale, rows, dtype, kc=kc)
    return gather_ref(table, scale, rows, dtype)
