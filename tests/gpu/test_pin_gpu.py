"""GPU tier: a pinned host tensor's registration ends when the tensor is collected.

A registration left behind after its memory is freed is inherited by the next allocation at
those addresses: a GPU tier once saw a later model's embedding copy fail with "invalid
argument" after the offload tests had loaded and dropped many models."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from ftchat.model.ngram_table import page_tensor
from ftchat import host_memory

pytestmark = pytest.mark.gpu


def _register(t: torch.Tensor) -> int:
    """cudaHostRegister of t's bytes: 0, or the CUDA error code."""
    return int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))


def _pin_a_view_and_drop_it() -> torch.Tensor:
    base = page_tensor((1 << 20,), torch.uint8)  # own pages; its memory outlives the view
    view = base[:]
    host_memory.pin(view)
    assert view.is_pinned() and base.is_pinned()
    del view
    gc.collect()
    return base


def test_registration_ends_when_the_pinned_tensor_is_collected():
    base = _pin_a_view_and_drop_it()
    assert not base.is_pinned()
    assert _register(base) == 0  # the old entry is gone: the range registers again
    torch.cuda.cudart().cudaHostUnregister(base.data_ptr())


def test_control_without_the_unregistration_the_entry_stays(monkeypatch):
    monkeypatch.setattr(host_memory.weakref, "finalize", lambda *a, **k: types.SimpleNamespace())
    base = _pin_a_view_and_drop_it()
    assert base.is_pinned()  # stale: the view is gone, its registration is not
    # no refused cudaHostRegister here to show it: the runtime keeps that error as its last
    # one, and the next kernel launch anywhere in the process raises it (the first test of
    # the next file then fails with "already mapped")
    assert int(torch.cuda.cudart().cudaHostUnregister(base.data_ptr())) == 0  # entry dropped
