"""--prefill-chunk T: a prompt is prefilled T tokens a call (fewer, larger calls copy
each layer's experts fewer times on CUDA); the reply does not depend on T, and the VRAM plan
sizes the prefill workspace for T. Decoder.prefill returns the last position's logits only
([T, V] of a 255K prompt is ~126 GB) unless all_logits."""

from __future__ import annotations

import pytest
import torch

from ftchat import engine
from ftchat.errors import SettingsError
from ftchat.model import qwen4_exp
from ftchat.session import Session
from ftchat.settings import Settings, resolve_settings
from ftchat.sizes import PREFILL_CHUNK
from ftchat.vram.workloads import checkpoint_inputs, run_workload


def _reply(folder, chunk, monkeypatch) -> tuple[list[int], list[int]]:
    # the reply's tokens and the length of every prefill call the engine made
    calls = []
    real = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda m, st, row, ids, start, ex, **kw:
                        calls.append(len(ids)) or real(m, st, row, ids, start, ex, **kw))
    s = Session.open(folder, Settings(max_new_tokens=6, prefill_chunk=chunk))
    ids = s.turn_ids("Tell me something about the sea and the sky.")
    tokens = [r.token for r in s.chat(ids)]
    monkeypatch.undo()
    assert sum(calls) == len(ids)
    return tokens, calls


def test_the_chunk_sets_the_calls_not_the_reply(tiny_nvfp4, monkeypatch):
    default, calls = _reply(tiny_nvfp4, None, monkeypatch)
    assert calls == [sum(calls)]  # a short prompt: one call of PREFILL_CHUNK
    small, calls = _reply(tiny_nvfp4, 5, monkeypatch)
    assert len(calls) > 2 and set(calls[:-1]) == {5} and calls[-1] <= 5
    assert small == default


def test_the_flag_and_the_plan(tiny_nvfp4):
    assert resolve_settings({"prefill_chunk": "4096"}, {}).prefill_chunk == 4096
    with pytest.raises(SettingsError, match="--prefill-chunk 0: expected a positive integer"):
        resolve_settings({"prefill_chunk": 0}, {})
    a, layout = checkpoint_inputs(tiny_nvfp4)
    w = run_workload(a, layout, Settings(context=2048, prefill_chunk=512))
    assert w.prefill_tokens == 512
    short = run_workload(a, layout, Settings(context=300, prefill_chunk=512))
    assert short.prefill_tokens == 300
    assert run_workload(a, layout, Settings(context=2048)).prefill_tokens == PREFILL_CHUNK


# ===== the last position's logits only =====

PROMPT = torch.tensor([3, 17, 99, 4, 250, 31, 7, 7, 12, 400, 5, 66, 81, 9, 140, 2, 23])  # 17


def _final_mixer_rows(monkeypatch) -> list[int]:
    # the rows each final mixer call (the only one without inject) gets, in order
    rows, real = [], qwen4_exp.hc_write_read

    def spy(R, y, s, w, a, inject=True, **kw):
        if not inject:
            rows.append(R.shape[0] * R.shape[1])
        return real(R, y, s, w, a, inject, **kw)

    monkeypatch.setattr(qwen4_exp, "hc_write_read", spy)
    return rows


def _prefilled(m, chunk: int | None, all_logits: bool, ids: torch.Tensor = PROMPT
               ) -> tuple[engine.Decoder, torch.Tensor]:
    dec = engine.Decoder(m, engine.resident_backend(m), 1, 32, prefill_chunk=chunk)
    return dec, dec.prefill(0, ids, 0, all_logits=all_logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 5])  # one call; 5, 5, 5, 2
def test_prefill_returns_the_last_row_of_every_logit(tiny_bf16, chunk, dtype, monkeypatch):
    m = engine.load_model(tiny_bf16, dtype=dtype)
    T, V = len(PROMPT), m.args.vocab_size
    rows = _final_mixer_rows(monkeypatch)
    dec_all, every = _prefilled(m, chunk, all_logits=True)
    assert every.shape == (T, V) and sum(rows) == T  # every chunk ran the mixer on every row
    rows.clear()
    dec, last = _prefilled(m, chunk, all_logits=False)
    assert last.shape == (1, V) and rows == [1]  # only the last chunk, on its last row
    # the final mixer and lm_head are per token: bit for bit in bf16 (CPU bf16 GEMMs give a row
    # the same bits whatever the row count); in fp32 MKL's one-row GEMV sums in another order
    # than its GEMM (~1e-6 here)
    if dtype == torch.bfloat16:
        assert torch.equal(last, every[-1:])
    else:
        assert (last - every[-1:]).abs().max().item() < 1e-5
    assert (last - every[-2:-1]).abs().max().item() > 1e-2  # control: a neighbouring row differs
    # the state is the same either way: the next decode step gives the same bits
    tok, lengths = last.argmax(-1), [T]
    assert torch.equal(dec.step(tok, lengths), dec_all.step(tok, lengths))


def test_chunked_prefill_of_every_logit_equals_one_call(tiny_bf16):
    m = engine.load_model(tiny_bf16)
    _, one = _prefilled(m, None, all_logits=True)
    _, chunked = _prefilled(m, 5, all_logits=True)
    assert chunked.shape == one.shape == (len(PROMPT), m.args.vocab_size)
    assert (chunked - one).abs().max().item() < 1e-5  # chunked GDN: fp32 summation order only
    # control: the later chunks carry the first one's state (its first token moves their logits)
    _, moved = _prefilled(m, 5, all_logits=True, ids=torch.cat([PROMPT[:1] + 1, PROMPT[1:]]))
    assert (moved[5:] - one[5:]).abs().max().item() > 1e-3
