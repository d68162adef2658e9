"""Fused CUDA kernels (Triton) and the one place that imports Triton.

CPU-only installs have no Triton: `HAS_TRITON` is False, `jit` returns the function unchanged
(so kernel modules still import), and every dispatcher falls back to its torch reference.
The decode kernels launch with programmatic dependent launch where the GPU has it (`pdl_launch`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs and CI
    triton = tl = None
    HAS_TRITON = False
try:  # grid dependency control (programmatic dependent launch), Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:
    gdc_launch_dependents = gdc_wait = None
    HAS_GDC = False
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def jit(fn=None, **kwargs):
    """`triton.jit` when Triton is present, else the identity; usable as @jit or @jit(...)."""
    if fn is None:
        return lambda f: jit(f, **kwargs)
    return triton.jit(fn, **kwargs) if HAS_TRITON else fn


_fused_on = True  # the decode model's fused kernels; off: the torch path on CUDA too


def use_fused(t) -> bool:
    """Whether the decoder runs its fused Triton kernels on tensor t's device (CUDA + Triton),
    unless switched off with `fused_kernels(False)` (bench's before/after arms)."""
    return _fused_on and HAS_TRITON and t.is_cuda


@contextmanager
def fused_kernels(on: bool) -> Iterator[None]:
    """Within the block the decoder uses (on) or skips (off) its fused kernels; a CUDA graph
    captured inside keeps the choice."""
    global _fused_on
    prev, _fused_on = _fused_on, on
    try:
        yield
    finally:
        _fused_on = prev


_pdl_on = os.environ.get("FTCHAT_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _pdl_device(device) -> bool:
    # programmatic dependent launch: Hopper (sm_90) and later, a real GPU, Triton with GDC
    return (HAS_GDC and not INTERPRET and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (9, 0))


def pdl_launch(t) -> dict:
    """Launch options of a decode kernel on tensor t's device: with programmatic dependent launch
    (PDL) the kernel may start while the kernel before it in the stream drains; it issues what
    depends on no earlier kernel (its weight loads), then `sync.pdl_wait` before it reads or
    writes anything else. {"PDL": True, "launch_pdl": True} where the device has it and it is
    on (FTCHAT_PDL=0 or `pdl_kernels(False)` switch it off), else {"PDL": False}."""
    if _pdl_on and t.is_cuda and _pdl_device(t.device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@contextmanager
def pdl_kernels(on: bool) -> Iterator[None]:
    """Within the block the decode kernels launch with (on) or without (off) PDL; a CUDA graph
    captured inside keeps the choice (bench's before/after arms)."""
    global _pdl_on
    prev, _pdl_on = _pdl_on, on
    try:
        yield
    finally:
        _pdl_on = prev


_rowloop_on = True


def use_rowloop() -> bool:
    """Whether the NVFP4 decode kernels take their row-loop defaults (the GDN input projection's
    GEMV at bs 1, the routed experts' kernel 1), unless switched off with `rowloop_kernels(False)`:
    then the tiled defaults from before them (bench's before/after arms)."""
    return _rowloop_on


@contextmanager
def rowloop_kernels(on: bool) -> Iterator[None]:
    """Within the block the NVFP4 decode kernels take (on) or skip (off) their row-loop defaults;
    a CUDA graph captured inside keeps the choice."""
    global _rowloop_on
    prev, _rowloop_on = _rowloop_on, on
    try:
        yield
    finally:
        _rowloop_on = prev


_one_row_on = True


def use_one_row() -> bool:
    """Whether the routed experts' row-loop kernel takes one h row a program at bs 1 (on by
    default: 192.7 vs 185.0 tok/s at 48 layers, 4K, on the H200) instead of the 2 rows it takes at
    bs 2 and above; switched with `one_row_kernels` (bench's `onerow=` arms)."""
    return _one_row_on


@contextmanager
def one_row_kernels(on: bool) -> Iterator[None]:
    """Within the block the routed experts take (on) or skip (off) the one-h-row tile at bs 1;
    a CUDA graph captured inside keeps the choice."""
    global _one_row_on
    prev, _one_row_on = _one_row_on, on
    try:
        yield
    finally:
        _one_row_on = prev
