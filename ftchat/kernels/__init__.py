"""Fused CUDA kernels (Triton) and the one place that imports Triton.

CPU-only installs have no Triton: `HAS_TRITON` is False, `jit` returns the function unchanged
(so kernel modules still import), and every dispatcher falls back to its torch reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs and CI
    triton = tl = None
    HAS_TRITON = False


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
