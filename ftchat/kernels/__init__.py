"""Fused CUDA kernels (Triton) and the one place that imports Triton.

CPU-only installs have no Triton: `HAS_TRITON` is False, `jit` returns the function unchanged
(so kernel modules still import), and every dispatcher falls back to its torch reference.
Which kernels run and how they launch is the KernelConfig each call is given
(ftchat/kernels/config.py): the decode kernels launch with programmatic dependent launch where
the config asks for it and the GPU has it (`pdl_launch`).
"""

from __future__ import annotations

import functools
import os

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


def jit(fn=None, **kwargs):
    """`triton.jit` when Triton is present, else the identity; usable as @jit or @jit(...)."""
    if fn is None:
        return lambda f: jit(f, **kwargs)
    return triton.jit(fn, **kwargs) if HAS_TRITON else fn


@functools.cache
def interpret() -> bool:
    """Whether Triton runs the kernels in its CPU interpreter (TRITON_INTERPRET=1). Triton reads
    the variable when a kernel is first decorated, so it is read once here too."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _pdl_device(device) -> bool:
    # programmatic dependent launch: Hopper (sm_90) and later, a real GPU, Triton with GDC
    return (HAS_GDC and not interpret() and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (9, 0))


def pdl_launch(t, pdl: bool) -> dict:
    """Launch options of a decode kernel on tensor t's device: with programmatic dependent launch
    (PDL) the kernel may start while the kernel before it in the stream drains; it issues what
    depends on no earlier kernel (its weight loads), then `sync.pdl_wait` before it reads or
    writes anything else. {"PDL": True, "launch_pdl": True} where pdl (KernelConfig.pdl) is on
    and the device has it, else {"PDL": False}."""
    if pdl and t.is_cuda and _pdl_device(t.device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
