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


class Switch:
    """A process-wide kernel choice that bench's before/after arms flip: read at each launch, so
    a CUDA graph captured while it holds keeps it. `switch.value` is the choice; `with
    switch.set(v):` changes it within the block."""

    def __init__(self, value: bool | int):
        self.value = value

    @contextmanager
    def set(self, value: bool | int) -> Iterator[None]:
        prev, self.value = self.value, value
        try:
            yield
        finally:
            self.value = prev


FUSED = Switch(True)  # the decode model's fused kernels; off: the torch path on CUDA too
PDL = Switch(os.environ.get("FTCHAT_PDL", "1") != "0")  # programmatic dependent launch
# the NVFP4 decode kernels' row-loop defaults (the GDN input projection's GEMV at bs 1, the
# routed experts' kernel 1); off: the tiled defaults from before them
ROWLOOP = Switch(True)
# the routed experts' row-loop kernel takes one h row a program at bs 1 instead of the 2 rows it
# takes at bs 2 and above (192.7 vs 185.0 tok/s at 48 layers, 4K, on the H200)
ONE_ROW = Switch(True)
# the HC read as one launch with a grid barrier between its parts (hyper._read_one_launch_kernel)
# instead of two kernels; off until measured at 48 layers (bench's hc1=1 arms)
HC_ONE_LAUNCH = Switch(False)
# the shared expert's down GEMV as extra programs of the routed experts' kernel 1 (one launch a
# layer fewer; expert_kernels.routed_experts_triton); off: its own launch before it. Off by
# default: at 48 layers it measured slower (185.5 against 198.6 tok/s at 4K, bench's fold=1
# arm beside resident, session 21)
SHARED_FOLD = Switch(False)
# resident experts address a layer's rows through a view of the bank at the layer's first row,
# so the router's ids are the slots; off: slots = (ids + layer * E).to(int32), two torch
# kernels a layer (offload.backend.ResidentExperts)
SLOT_VIEW = Switch(True)
# MiB of its next weights a decode kernel asks L2 for while it runs (ftchat/kernels/l2_prefetch.py);
# 0: none. Off until measured at 48 layers (bench's l2pf=N arms)
L2_PREFETCH = Switch(0)
# the GDN recurrence kernel loads its state slice before the PDL wait (no kernel of the step
# before it writes the state); off: after the wait. Off until measured (bench's gdnearly=1)
GDN_EARLY_STATE = Switch(False)
# the QSA layers' fused input projection [13952, 2560] through the Triton GEMV (gemv.linear: a
# PDL kernel, so no plain cuBLAS launch breaks the chain there) instead of cuBLAS, which
# measured 5-20 % faster alone at that size (bench_gemv.py); off until measured in the chain
# (bench's qsagemv=1)
QSA_PROJ_GEMV = Switch(False)
# the PLE layer's decode step in two kernels around its GEMVs (ftchat/kernels/ple_decode.py)
# instead of ~60 small torch kernels; off until measured (bench's plefused=1)
PLE_FUSED = Switch(False)
fused_kernels, pdl_kernels = FUSED.set, PDL.set
rowloop_kernels, one_row_kernels = ROWLOOP.set, ONE_ROW.set
hc_one_launch_kernels = HC_ONE_LAUNCH.set
shared_fold_kernels, slot_view_kernels = SHARED_FOLD.set, SLOT_VIEW.set
l2_prefetch_kernels, gdn_early_state_kernels = L2_PREFETCH.set, GDN_EARLY_STATE.set
qsa_proj_gemv_kernels, ple_fused_kernels = QSA_PROJ_GEMV.set, PLE_FUSED.set


def use_fused(t) -> bool:
    """Whether the decoder runs its fused Triton kernels on tensor t's device (CUDA + Triton)."""
    return FUSED.value and HAS_TRITON and t.is_cuda


def use_rowloop() -> bool:
    return ROWLOOP.value


def use_one_row() -> bool:
    return ONE_ROW.value


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
    if PDL.value and t.is_cuda and _pdl_device(t.device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
