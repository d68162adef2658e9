"""Chat, piped batches, verify, audit and bench all decode through engine.decode: a recording
stand-in for it sees every one of them, and their output is what the real loop yields."""

from __future__ import annotations

import pytest
import torch

from ftchat import engine
from ftchat.commands import bench
from ftchat.debug.audit_command import audit_prompts
from ftchat.debug.verify_command import verify_prompts
from ftchat.session import Session
from ftchat.settings import Settings


@pytest.fixture
def recorded(monkeypatch):
    calls: list[str] = []
    real = engine.decode

    def recording(dec, prompts, starts, limits, stops=frozenset()):
        calls.append(f"rows={len(prompts)} start={starts[0]}")
        yield from real(dec, prompts, starts, limits, stops)

    monkeypatch.setattr(engine, "decode", recording)
    return calls


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_chat_and_batch_run_the_engine_loop(tiny_nvfp4, recorded):
    s = Session.open(tiny_nvfp4, Settings(max_new_tokens=3))
    ids = s.turn_ids("hi")
    chat = [r.token for r in s.chat(ids)]
    assert recorded == ["rows=1 start=0"]
    turn2 = s.turn_ids("more")
    list(s.chat(turn2))
    assert recorded[1] == f"rows=1 start={len(ids) + len(chat) - 1}"  # continues the state
    batch = [r.token for r in s.generate_batch([ids], 3, stop_ids=frozenset())]
    assert len(recorded) == 3
    assert batch[: len(chat)] == chat  # same greedy tokens from the same prompt


def test_verify_audit_and_bench_run_the_engine_loop(tiny_nvfp4, recorded):
    m = engine.load_model(tiny_nvfp4)
    s = Settings(slots=20, prefetch="on")
    verdicts = verify_prompts(m, lambda text: [3, 17, 99, 4], s, 1, 4, "meta", audit_every=2)
    assert len(recorded) == 2 and verdicts[0].first_mismatch is None  # the off and on arms
    audit_prompts(m, [[3, 17, 99]], s, 2, 4)
    assert len(recorded) == 3
    arms = bench.parse_arms("off;on", s)
    out = bench.bench_context(m, arms, 16, s, steps=2, rounds=1)
    assert len(recorded) == 5 and set(out) == {"off", "on"}
    assert recorded[-1] == "rows=1 start=16"  # bench decodes from the context length
