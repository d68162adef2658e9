"""Prefix reuse in `ftchat serve`: a second turn prefills only what the kept state lacks, and its
greedy reply equals that of a server without checkpoints (`--cache-ram 0`)."""

from __future__ import annotations

import openai
import pytest

from ftchat.model.tokenizer import Tokenizer
from tests.server_util import ROOT, start_server

FLAGS = ("--context", "1024")
# an agent's system prompt is long: ~345 tokens, above worker.CHECKPOINT_MIN_TOKENS (a shorter
# one gets no checkpoint of its own)
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in Python. " + " ".join(
    f"Rule {i}: keep functions short and name them for what they do." for i in range(20))}
U1 = {"role": "user", "content": "Write a function that adds two numbers."}
U1_EDITED = {"role": "user", "content": "Write a function that multiplies two numbers."}
U2 = {"role": "user", "content": "Now make it add three numbers."}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefix")
    warm = start_server(tmp, *FLAGS)
    cold = start_server(tmp, *FLAGS, "--cache-ram", "0")
    yield warm, cold
    warm.stop()
    cold.stop()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(ROOT / "ftchat" / "models" / "demo")


def chat(server, messages, n=8):
    c = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    r = c.chat.completions.create(model="demo", messages=messages, max_tokens=n)
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def prefix_len(tok, messages) -> int:
    return len(tok.encode(tok.render_chat(messages, add_generation_prompt=False)))


def test_second_turn_reuses_the_history(servers, tok):
    warm, cold = servers
    first, cached = chat(warm, [SYSTEM, U1])
    assert cached == 0
    chat(warm, [{"role": "user", "content": "hello"}])  # a side call takes the decode row
    turn2 = [SYSTEM, U1, {"role": "assistant", "content": first}, U2]
    reply, cached = chat(warm, turn2)
    assert cached == prefix_len(tok, [SYSTEM, U1])  # restored from the history checkpoint
    cold_reply, cold_cached = chat(cold, turn2)
    assert cold_cached == 0 and reply == cold_reply


def test_an_edit_mid_history_restores_the_system_prefix(servers, tok):
    warm, cold = servers
    first, _ = chat(warm, [SYSTEM, U1])
    edited = [SYSTEM, U1_EDITED, {"role": "assistant", "content": first}, U2]
    reply, cached = chat(warm, edited)
    assert cached == prefix_len(tok, [SYSTEM])
    assert reply == chat(cold, edited)[0]


def test_the_same_request_again_prefills_nothing_and_replies_the_same(servers):
    # a retry or a regenerated reply: the whole prompt's checkpoint and its last logits are
    # restored, nothing is prefilled, and the reply is the cold server's, greedy and sampled
    warm, cold = servers
    messages = [SYSTEM, {"role": "user", "content": "Write a function that sorts a list."}]
    c = openai.OpenAI(base_url=warm.base_url, api_key="none", max_retries=0)
    cold_c = openai.OpenAI(base_url=cold.base_url, api_key="none", max_retries=0)
    for sampling in ({}, {"temperature": 0.9, "seed": 7}):
        first = c.chat.completions.create(model="demo", messages=messages, max_tokens=8,
                                          **sampling)
        again = c.chat.completions.create(model="demo", messages=messages, max_tokens=8,
                                          **sampling)
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
        assert again.model_extra["timings"]["prompt_n"] == 0
        ref = cold_c.chat.completions.create(model="demo", messages=messages, max_tokens=8,
                                             **sampling)
        assert ref.usage.prompt_tokens_details.cached_tokens == 0
        text = [r.choices[0].message.content for r in (first, again, ref)]
        assert text[0] == text[1] == text[2], (sampling, text)


def test_a_prompt_that_extends_the_kept_state(servers, tok):
    warm, cold = servers
    c = openai.OpenAI(base_url=warm.base_url, api_key="none", max_retries=0)
    prompt = tok.render_chat([U1])
    first = c.completions.create(model="demo", prompt=prompt, max_tokens=6).choices[0].text
    longer = prompt + first + "\n# more"
    r = c.completions.create(model="demo", prompt=longer, max_tokens=6)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(tok.encode(prompt))
    # llama-server's `timings`: the engine prefilled only the rest; its decode steps made every
    # token but the first (which ends the prefill)
    t = r.model_extra["timings"]
    assert (t["cache_n"], t["prompt_n"]) == (cached, r.usage.prompt_tokens - cached), t
    assert t["predicted_n"] == r.usage.completion_tokens - 1 and t["predicted_ms"] > 0, (t, r.usage)
    assert t["predicted_per_second"] > 0 and t["prompt_per_second"] > 0, t
    cold_c = openai.OpenAI(base_url=cold.base_url, api_key="none", max_retries=0)
    assert r.choices[0].text == cold_c.completions.create(
        model="demo", prompt=longer, max_tokens=6).choices[0].text
