"""Fused CUDA kernels (Triton) and the one place that imports Triton.

CPU-only installs have no Triton: `HAS_TRITON` is False, `jit` returns the function unchanged
(so kernel modules still import), and every dispatcher falls back to its torch reference.
"""

from __future__ import annotations

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
