"""Session: batch generation and chat against the engine's own greedy generate."""

from __future__ import annotations

import time

import pytest
import torch

from ftchat import engine
from ftchat.errors import FtchatError
from ftchat.model.expert_backend import ForwardingBackend
from ftchat.session import Session, StopText
from ftchat.settings import Settings

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Two OpenMP threads on two shared cores spin against each other (~20x slower).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def session(tiny_nvfp4):
    return Session.open(tiny_nvfp4, Settings())


def greedy(s: Session, ids: list[int], n: int) -> list[int]:
    """The engine's own greedy tokens for one prompt (no stop rule)."""
    return [step.tokens[0] for step in engine.generate(s.model, [ids], n, s.experts)]


def until_stop(tokens: list[int], stops) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


def by_seq(records) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in records:
        out.setdefault(r.seq, []).append(r.token)
    return out


def test_batch_matches_engine_and_stops_on_eos(session):
    s = session
    prompts = [s.encode_messages(HELLO), s.encode_messages([{"role": "user", "content": "2+2?"}])]
    records = list(s.generate_batch(prompts, 12))
    got = by_seq(records)
    for i, p in enumerate(prompts):
        ref = greedy(s, p, 12)
        assert got[i] == until_stop(ref, s.tokenizer.eos_ids)
    # "hello" on this checkpoint ends with <|im_end|> after 8 tokens: the stop rule is exercised
    assert len(got[0]) < 12 and got[0][-1] == s.im_end
    finals = [r for r in records if r.stop]
    assert [(r.seq, r.stop) for r in finals] == [(0, "eos"), (1, "length")]
    assert [r.n for r in records if r.seq == 1] == list(range(1, 13))


def test_batch_size_two_with_per_prompt_limits(tiny_nvfp4):
    s = Session.open(tiny_nvfp4, Settings(batch_size=2))
    prompts = [s.encode_messages([{"role": "user", "content": t}]) for t in ("a", "bb", "ccc")]
    got = by_seq(s.generate_batch(prompts, [3, 9, 5], stop_ids=frozenset()))
    pair = [step.tokens for step in engine.generate(s.model, prompts[:2], 9, s.experts)]
    assert got[0] == [t[0] for t in pair][:3]
    assert got[1] == [t[1] for t in pair]
    assert got[2] == greedy(s, prompts[2], 5)


def test_custom_stop_ids_end_a_sequence_at_the_first_match(session):
    p = session.encode_messages([{"role": "user", "content": "What is 2+2?"}])
    ref = greedy(session, p, 10)
    stop = ref[4]
    records = list(session.generate_batch([p], 10, stop_ids=frozenset({stop})))
    assert [r.token for r in records] == ref[: ref.index(stop) + 1]
    assert records[-1].stop == "eos" and all(r.stop is None for r in records[:-1])


def test_figures_count_prefill_and_decode(session):
    p = session.encode_messages(HELLO)
    records = list(session.generate_batch([p], 5, stop_ids=frozenset()))
    f = records[-1].figures
    assert (f.prefill_tokens, f.decode_tokens, f.tokens) == (len(p), 4, 5)
    assert f.context == len(p) + 4  # the 5th token is never fed back
    assert f.decode_tps is not None and f.prefill_tps is not None
    assert (f.vram_used, f.vram_peak) == (None, None)  # CPU
    assert records[0].figures.decode_tps is None  # no decode step yet


def test_prompt_longer_than_context_is_refused(tiny_nvfp4):
    s = Session.open(tiny_nvfp4, Settings(context=16))
    long = s.encode_messages([{"role": "user", "content": "word " * 20}])
    short = s.encode_messages([{"role": "user", "content": "hi"}])
    assert len(short) <= 16 < len(long)
    assert len(list(s.generate_batch([short], 1))) == 1  # control
    with pytest.raises(FtchatError, match=r"prompt 2 has \d+ tokens, more than the context \(16\)"):
        s.generate_batch([short, long], 1)
    with pytest.raises(FtchatError, match="more than the context"):
        s.chat(long)
    assert s.length == 0


def test_reply_stops_when_the_context_is_full(tiny_nvfp4):
    s = Session.open(tiny_nvfp4, Settings(context=30, max_new_tokens=100))
    p = s.encode_messages([{"role": "user", "content": "What is 2+2?"}])
    records = list(s.generate_batch([p], 100, stop_ids=frozenset()))
    assert records[-1].stop == "context" and len(records) == 30 - len(p) + 1
    assert [r.token for r in records] == greedy(s, p, len(records))


@pytest.mark.parametrize("first, ends_on_eos", [
    ("The quick brown fox jumps over the lazy dog.", False), ("hello", True)])
def test_chat_keeps_the_conversation(tiny_nvfp4, first, ends_on_eos):
    s = Session.open(tiny_nvfp4, Settings(max_new_tokens=16))
    t1 = s.turn_ids(first)
    r1 = [r.token for r in s.chat(t1)]
    assert (r1[-1] in s.tokenizer.eos_ids) == ends_on_eos  # both ways of ending a turn
    t2 = s.turn_ids("more")
    assert s.tokenizer.decode(t2).startswith("\n<|im_start|>user\nmore")
    r2 = [r.token for r in s.chat(t2)]
    # The turn is closed by <|im_end|>, which takes the place of a stop token.
    body = r1[:-1] if r1[-1] in s.tokenizer.eos_ids else r1
    history = t1 + body + [s.im_end] + t2
    assert r2 == until_stop(greedy(s, history, 16), s.tokenizer.eos_ids)
    # negative control: without the history the same turn gives another reply
    alone = s.encode_messages([{"role": "user", "content": "more"}])
    assert r2 != until_stop(greedy(s, alone, 16), s.tokenizer.eos_ids)


def test_chat_closed_mid_reply_keeps_what_was_shown(tiny_nvfp4):
    s = Session.open(tiny_nvfp4, Settings(max_new_tokens=50))
    t1 = s.turn_ids("What is 2+2?")
    replies, shown = s.chat(t1), []
    for r in replies:
        shown.append(r.token)
        if len(shown) == 5:
            break
    replies.close()  # what Ctrl-C does, between steps
    assert s.length == len(t1) + 4 and s.context_used == len(t1) + 6  # + last token, <|im_end|>
    t2 = s.turn_ids("go on")
    r2 = [r.token for r in s.chat(t2)][:6]
    history = t1 + shown + [s.im_end] + t2
    assert r2 == greedy(s, history, 6)


def test_reset_starts_over(tiny_nvfp4):
    s = Session.open(tiny_nvfp4, Settings(max_new_tokens=6))
    first = [r.token for r in s.chat(s.turn_ids("hello"))]
    again = [r.token for r in s.chat(s.turn_ids("hello"))]  # a second turn: other ids
    s.reset()
    assert s.length == 0 and s.turn_ids("hello") == s.encode_messages(HELLO)
    assert [r.token for r in s.chat(s.turn_ids("hello"))] == first
    assert again != first  # control: without the reset the turn differs


def test_conversation_full_is_refused_and_kept(tiny_nvfp4):
    s = Session.open(tiny_nvfp4, Settings(context=40, max_new_tokens=4))
    t1 = s.turn_ids("hi")
    list(s.chat(t1))
    before = s.length
    with pytest.raises(FtchatError, match="conversation is full.*/reset"):
        s.chat(s.turn_ids("a much longer second message that cannot fit in forty tokens"))
    assert s.length == before
    assert len(list(s.chat(s.turn_ids("ok")))) >= 1  # a turn that fits still works


class _FailingExperts(ForwardingBackend):
    """Wraps a backend; raises KeyboardInterrupt inside the n-th decode-step MoE call."""

    def __init__(self, inner, fail_at: int | None):
        super().__init__(inner)
        self.fail_at, self.calls = fail_at, 0

    def begin(self, layer, x, ids):
        if x.shape[0] == 1:  # decode steps only (prefill has T > 1 tokens)
            self.calls += 1
            if self.calls == self.fail_at:
                raise KeyboardInterrupt
        return self.inner.begin(layer, x, ids)


@pytest.mark.parametrize("fail_at", [None, 9])
def test_interrupt_inside_a_step_resets_the_conversation(tiny_nvfp4, fail_at):
    base = Session.open(tiny_nvfp4, Settings(max_new_tokens=4))
    s = Session(base.model, base.tokenizer, base.settings, _FailingExperts(base.experts, fail_at))
    t1 = s.turn_ids("What is 2+2?")
    if fail_at is None:  # control: the reply completes and the conversation grows
        assert len(list(s.chat(t1))) == 4 and s.length == len(t1) + 3
        return
    with pytest.raises(KeyboardInterrupt):
        list(s.chat(t1))  # step 2, layer 3 of 6: the state is half-written
    assert (s.length, s.context_used) == (0, 0)
    fresh = Session.open(tiny_nvfp4, Settings(max_new_tokens=4))
    s.experts.fail_at = None
    assert [r.token for r in s.chat(s.turn_ids("hi"))] == [
        r.token for r in fresh.chat(fresh.turn_ids("hi"))]


def test_close_reaches_the_backend(tiny_nvfp4):
    base = Session.open(tiny_nvfp4, Settings())
    base.close()  # the resident backend's close() has nothing to do

    class Closing(_FailingExperts):
        closed = 0

        def close(self):
            self.closed += 1

    s = Session(base.model, base.tokenizer, base.settings, Closing(base.experts, None))
    s.close()
    assert s.experts.closed == 1


def test_a_long_stop_string_costs_what_the_held_text_costs():
    # a request may send 1 MB stop strings: the held-back end is searched only as far as the
    # text held (before: every prefix of every stop string, each token; the server's engine
    # thread spent minutes a token)
    text = StopText(["x" * 300_000, "END"])
    t = time.perf_counter()
    shown = [text.feed(piece) for piece in ["say ", "it ", "E"] + ["word "] * 10]
    assert time.perf_counter() - t < 1.0
    assert shown[:3] == ["say ", "it ", ""] and shown[3] == "Eword "  # "E" held, then shown
    assert text.feed("the EN") == "the " and text.feed("D x") == "" and text.hit == "END"
