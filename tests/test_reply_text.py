"""ReplyText: the shown text of a streamed reply, without an empty think block at its start."""

from __future__ import annotations

import random
import re

import pytest

from ftchat.model.tokenizer import Tokenizer
from ftchat.resolve import SHIPPED_DEMO
from ftchat.ui.text import ReplyText


def shown(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    r = ReplyText(tok)
    outs = [r.feed(i) for i in ids]
    return outs, r.flush()


def expected(text: str) -> str:
    """The rule on the whole text: every </think> before other text is dropped, with the
    whitespace before it, then the newlines after the last one."""
    m = re.match(r"(\s*</think>)+\n*", text)
    return text[m.end():] if m else text


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(SHIPPED_DEMO)


@pytest.mark.parametrize("text, want", [
    ("\n</think>\n\n```python\nx = 1\n```", "```python\nx = 1\n```"),  # the demo's replies
    ("</think>hello", "hello"),
    ("\n</think>\n\n", ""),  # nothing but the closed block
    ("Let me think.\n</think>\n\nYes.", "Let me think.\n</think>\n\nYes."),  # reasoning: kept
    ("</th is not the tag", "</th is not the tag"),
    ("hello </think> later", "hello </think> later"),
    ("  \n  ", "  \n  "),
    ("</think>\n\n</think>\n\n```python\nx = 1\n```", "```python\nx = 1\n```"),  # twice
    ("</think>\n</think>  x", "  x"),
    ("</think>\n\n</th", "</th"),
    ("</think>\nok</think>", "ok</think>"),  # after the reply starts, a tag is text
])
def test_cases(tok, text, want):
    ids = tok.encode(text)
    outs, rest = shown(tok, ids)
    assert "".join(outs) + rest == want == expected(tok.decode(ids))


def test_the_demo_reply_streams_without_waiting_for_the_end(tok):
    ids = tok.encode("\n</think>\n\nA tuple is an immutable sequence.")
    outs, rest = shown(tok, ids)
    first = next(i for i, o in enumerate(outs) if o)
    assert outs[first].startswith("A") and rest == ""
    assert first <= ids.index(tok.special_ids["</think>"]) + 3  # held back only the block


def test_random_texts_match_the_rule(tok):
    rng = random.Random(0)
    parts = ["</think>", "\n", " ", "<think>", "def f():", "x", "</th", "ink>", "😀", "\n\n"]
    for _ in range(300):
        text = "".join(rng.choice(parts) for _ in range(rng.randrange(0, 8)))
        ids = tok.encode(text)
        outs, rest = shown(tok, ids)
        assert "".join(outs) + rest == expected(tok.decode(ids)), repr(text)


def test_the_demo_model_closing_the_block_twice(tok):
    # The shipped demo model's greedy reply to "hi" (a stray second </think> must not show)
    ids = [8191, 272, 8191, 272, 395, 63, 2729, 198, 475, 6258, 6701, 345, 258, 382, 1994, 8141,
           16, 428, 395, 63]
    assert tok.decode(ids).startswith("</think>\n\n</think>\n\n```python")
    outs, rest = shown(tok, ids)
    assert "".join(outs) + rest == "```python\ndef reverse(text):\n    return text[::-1]\n```"
