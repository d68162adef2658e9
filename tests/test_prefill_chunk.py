"""--prefill-chunk T (issue 17): a prompt is prefilled T tokens a call (fewer, larger calls copy
each layer's experts fewer times on CUDA); the reply does not depend on T, and the VRAM plan
sizes the prefill workspace for T."""

from __future__ import annotations

import pytest
import torch

from ftchat import engine
from ftchat import vram_plan as vp
from ftchat.errors import SettingsError
from ftchat.session import Session
from ftchat.settings import Settings, resolve_settings


def _reply(folder, chunk, monkeypatch) -> tuple[list[int], list[int]]:
    # the reply's tokens and the length of every prefill call the engine made
    calls = []
    real = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda m, st, row, ids, start, ex:
                        calls.append(len(ids)) or real(m, st, row, ids, start, ex))
    s = Session.open(folder, Settings(max_new_tokens=6, prefill_chunk=chunk))
    ids = s.turn_ids("Tell me something about the sea and the sky.")
    tokens = [r.token for r in s.chat(ids)]
    monkeypatch.undo()
    assert sum(calls) == len(ids)
    return tokens, calls


def test_the_chunk_sets_the_calls_not_the_reply(tiny_nvfp4, monkeypatch):
    default, calls = _reply(tiny_nvfp4, None, monkeypatch)
    assert calls == [sum(calls)]  # a short prompt: one call of engine.PREFILL_CHUNK
    small, calls = _reply(tiny_nvfp4, 5, monkeypatch)
    assert len(calls) > 2 and set(calls[:-1]) == {5} and calls[-1] <= 5
    assert small == default


def test_the_flag_and_the_plan(tiny_nvfp4):
    assert resolve_settings({"prefill_chunk": "4096"}, {}).prefill_chunk == 4096
    with pytest.raises(SettingsError, match="--prefill-chunk 0: expected a positive integer"):
        resolve_settings({"prefill_chunk": 0}, {})
    a, layout = vp.checkpoint_inputs(tiny_nvfp4)
    w = vp.run_workload(a, layout, Settings(context=2048, prefill_chunk=512))
    assert w.prefill_tokens == 512
    short = vp.run_workload(a, layout, Settings(context=300, prefill_chunk=512))
    assert short.prefill_tokens == 300
    assert vp.run_workload(a, layout, Settings(context=2048)).prefill_tokens == engine.PREFILL_CHUNK
