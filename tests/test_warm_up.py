"""The load-time warm-up: on CUDA, `ftchat run` makes the first reply's decoder (its
graph capture compiles the decode kernels) and prefills a few tokens before the first prompt, so
the first reply's prompt eval times the prefill alone. Here on the CPU: the warm-up leaves the
session as cold as a fresh one (same tokens, same expert misses), and run calls it only where it
is asked for (the decision is stubbed: CPU sessions do not warm up by themselves)."""

from __future__ import annotations

import dataclasses
import io
import sys
import time

import torch

from ftchat import engine
from ftchat.cli import main
from ftchat.session import WARM_UP_TOKENS, Session
from ftchat.settings import Settings


def _reply(s: Session) -> tuple[list[int], float]:
    # the reply's tokens and the expert misses it cost (a small slot cache: misses show state)
    records = list(s.chat(s.turn_ids("What is 2+2?")))
    return [r.token for r in records], records[-1].figures.offload["misses"]


SETTINGS = Settings(max_new_tokens=8, slots=24)


def test_warm_up_prefills_the_prompt_path_once_and_times_it(tiny_nvfp4, monkeypatch):
    """warm_up makes the chat decoder and prefills WARM_UP_TOKENS <|im_end|> tokens into its row
    0 through Decoder.prefill (the prompt path whose kernels the first reply runs); it returns
    the seconds that took, within the wall time around the call."""
    s = Session.open(tiny_nvfp4, SETTINGS)
    calls, real = [], engine.Decoder.prefill

    def spy(dec, row, ids, start, *args, **kwargs):
        calls.append((dec, row, ids.tolist(), start))
        return real(dec, row, ids, start, *args, **kwargs)

    monkeypatch.setattr(engine.Decoder, "prefill", spy)
    t0 = time.perf_counter()
    took = s.warm_up()
    wall = time.perf_counter() - t0
    assert s._chat is not None and s.length == 0
    assert calls == [(s._chat, 0, [s.im_end] * min(WARM_UP_TOKENS, s.max_len), 0)]
    assert 0 < took <= wall


def test_warm_up_leaves_a_cold_session(tiny_nvfp4):
    cold = _reply(Session.open(tiny_nvfp4, SETTINGS))
    s = Session.open(tiny_nvfp4, SETTINGS)
    s.warm_up()
    assert s.length == 0 and s._chat is not None
    dec = s._chat
    assert _reply(s) == cold and s._chat is dec  # the warmed decoder serves the reply
    b = Session.open(tiny_nvfp4, SETTINGS)
    b.warm_up(1)  # --prompt's one-row batch decoder
    assert 1 in b._batch
    got = [r.token for r in b.generate_batch([b.turn_ids("What is 2+2?")])]
    assert got == cold[0][: len(got)]


def test_warm_up_leaves_the_state_as_created(tiny_nvfp4, monkeypatch):
    s = Session.open(tiny_nvfp4, SETTINGS)
    s.warm_up()
    fresh = engine.Decoder(s.model, s.experts, 1, s.max_len).state
    assert all(torch.equal(a, b) for a, b in zip(s._chat.state.tensors(), fresh.tensors(),
                                                strict=True))
    # control: a warm-up without the reset leaves its prefill in the state
    s = Session.open(tiny_nvfp4, SETTINGS)
    monkeypatch.setattr(engine.Decoder, "reset", lambda self, experts=True: None)
    s.warm_up()
    monkeypatch.undo()
    assert not all(torch.equal(a, b) for a, b in zip(s._chat.state.tensors(), fresh.tensors()))


def test_who_warms_up(tiny_nvfp4):
    s = Session.open(tiny_nvfp4, Settings())
    assert not s.warms_up()  # the CPU: nothing to compile or capture
    s.model = dataclasses.replace(s.model, device=torch.device("cuda"))
    assert s.warms_up()
    s.settings = Settings(audit_every=4)
    assert not s.warms_up()  # a watcher would record the warm-up's tokens


def _run(argv, capsys, monkeypatch, stdin_text=""):
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin_text.encode())))
    code = main([str(a) for a in argv])
    return (code, *capsys.readouterr())


def test_run_warms_up_the_first_replys_decoder(tiny_nvfp4, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(Session, "warms_up", lambda self: True)
    real = Session.warm_up
    monkeypatch.setattr(Session, "warm_up", lambda self, rows=None: calls.append(rows) or
                        real(self, rows))
    code, out, err = _run(["run", tiny_nvfp4, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    assert code == 0 and calls == [1], err
    assert "warming up" in err and "warmed up in" in err and "prompt eval" in err
    calls.clear()  # piped prompts: the batch size is not known yet, no warm-up
    code, out, err = _run(["run", tiny_nvfp4, "-n", "2"], capsys, monkeypatch, "hi\nthere\n")
    assert code == 0 and calls == [] and "warmed up" not in err, err
    monkeypatch.setattr(Session, "warms_up", lambda self: False)  # control: not asked for
    code, out, err = _run(["run", tiny_nvfp4, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    assert code == 0 and calls == [] and "warm" not in err
