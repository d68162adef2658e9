"""Synthetic tokenizer files, Tokenizer (encode/decode/chat template) and StreamDecoder."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from ftchat.errors import ModelError
from ftchat.model.tokenizer import StreamDecoder, Tokenizer, write_synthetic_tokenizer

REAL_IDS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<think>": 248068,
    "</think>": 248069,
}
TINY_IDS = {
    "<|endoftext|>": 507,
    "<|im_start|>": 508,
    "<|im_end|>": 509,
    "<think>": 510,
    "</think>": 511,
}

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 2024, isn't it?",
    "python": (
        'def add(a: int, b: int) -> int:\n    """Sum."""\n    return a + b\n\n\n'
        "print(add(1, 2))\n"
    ),
    "emoji": "Great job 😀👍🏽 see you 🎉!",
    "cjk": "中文字符测试，日本語のテキスト、한국어 문장.",
    "mixed": "Grüße, café — “quotes” ∑ x² → ∞\ttab\r\nnewline  two  spaces",
}

SYSTEM_USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
]
MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3? 中文 😀"},
]


def _folder(base: Path, vocab_size: int, special_base: int | None) -> Path:
    write_synthetic_tokenizer(base, vocab_size, special_base)
    # AutoTokenizer needs a config to pick the class; qwen4_exp maps to Qwen3_5Tokenizer.
    (base / "config.json").write_text(json.dumps({"model_type": "qwen4_exp"}))
    return base


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _folder(tmp_path_factory.mktemp("tiny"), 512, None)


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Path:
    return _folder(tmp_path_factory.mktemp("real"), 248320, 248044)


@pytest.fixture(scope="module", params=["tiny", "real"])
def folder(request, tiny, real) -> Path:
    return {"tiny": tiny, "real": real}[request.param]


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


# ===== files and special ids =====


def test_special_ids_real_geometry(real):
    tok = Tokenizer.from_folder(real)
    assert write_synthetic_tokenizer(real / "again", 248320, 248044) == REAL_IDS
    for content, tid in REAL_IDS.items():
        assert tok.special_ids[content] == tid
        assert tok.encode(content) == [tid]
        assert tok.decode([tid]) == content
    assert tok.eos_ids == {248046, 248044}
    # Sparse vocab, not padded: the file stays small although ids reach 248069.
    assert (real / "tokenizer.json").stat().st_size < 200_000


def test_special_ids_tiny(tiny):
    tok = Tokenizer.from_folder(tiny)
    assert tok.special_ids == TINY_IDS
    assert all(tok.encode(c) == [i] for c, i in TINY_IDS.items())
    assert tok.backend.get_vocab_size() == 512  # every id below vocab_size, none above


def test_think_tags_are_not_special(tiny):
    added = Tokenizer.from_folder(tiny).backend.get_added_tokens_decoder().values()
    flags = {t.content: t.special for t in added}
    assert flags == {
        "<|endoftext|>": True,
        "<|im_start|>": True,
        "<|im_end|>": True,
        "<think>": False,
        "</think>": False,
    }


def test_tokenizer_config_fields(real):
    cfg = json.loads((real / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>"
    assert cfg["pad_token"] == "<|endoftext|>"
    assert cfg["bos_token"] is None
    assert cfg["added_tokens_decoder"]["248068"]["content"] == "<think>"
    assert cfg["added_tokens_decoder"]["248046"]["special"] is True


def test_transformers_sees_same_ids(folder, hf):
    expected = REAL_IDS if "real" in folder.name else TINY_IDS
    assert type(hf).__name__ == "Qwen3_5Tokenizer"
    assert {c: hf.convert_tokens_to_ids(c) for c in expected} == expected
    assert hf.eos_token_id == expected["<|im_end|>"]
    assert hf.pad_token_id == expected["<|endoftext|>"]


def test_deterministic_across_processes(tmp_path):
    # Separate processes with different hash seeds: Rust/Python hash order must not leak in.
    code = (
        "import sys; from pathlib import Path; "
        "from ftchat.model.tokenizer import write_synthetic_tokenizer as w; "
        "w(Path(sys.argv[1]), 248320, 248044); w(Path(sys.argv[1]) / 'tiny', 512)"
    )
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env)
        outs.append(out)
    names = ["tokenizer.json", "tokenizer_config.json", "tiny/tokenizer.json"]
    for name in names:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    # Negative control: the byte comparison does see a difference in the vocab.
    tiny_bytes = (outs[0] / "tiny/tokenizer.json").read_bytes()
    assert (outs[0] / "tokenizer.json").read_bytes() != tiny_bytes


# ===== encode / decode =====


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_round_trip(folder, hf, name):
    tok = Tokenizer.from_folder(folder)
    ids = tok.encode(TEXTS[name])
    assert tok.decode(ids) == TEXTS[name]
    assert ids == hf.encode(TEXTS[name], add_special_tokens=False)
    assert all(0 <= i < 248320 for i in ids)


def test_merges_compress_english(tiny):
    tok = Tokenizer.from_folder(tiny)
    text = TEXTS["english"]
    assert len(tok.encode(text)) < len(text.encode()) * 0.7  # learned merges, not bare bytes


def test_qwen_split_and_nfc(tiny):
    tok = Tokenizer.from_folder(tiny)
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]  # one digit each
    assert tok.decode(tok.encode("cafe\u0301")) == "caf\u00e9"  # NFC normaliser
    assert tok.encode("") == []


def test_specials_inside_text(folder):
    tok = Tokenizer.from_folder(folder)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    im_start, im_end = tok.special_ids["<|im_start|>"], tok.special_ids["<|im_end|>"]
    assert ids[0] == im_start and im_end in ids
    assert ids.count(im_start) == 1 and ids.count(im_end) == 1


# ===== chat template =====


@pytest.mark.parametrize("messages", [SYSTEM_USER, MULTI_TURN], ids=["system_user", "multi_turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_render_matches_transformers(folder, hf, messages, add_generation_prompt, enable_thinking):
    tok = Tokenizer.from_folder(folder)
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    got = tok.render_chat(messages, add_generation_prompt, enable_thinking)
    assert got == expected


def test_render_literal(tiny):
    tok = Tokenizer.from_folder(tiny)
    head = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    assert tok.render_chat(SYSTEM_USER) == head + "<|im_start|>assistant\n<think>\n"
    assert tok.render_chat(SYSTEM_USER, enable_thinking=False) == (
        head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.render_chat(SYSTEM_USER, add_generation_prompt=False) == head


def test_render_drops_old_reasoning_keeps_final(tiny):
    tok = Tokenizer.from_folder(tiny)
    # The earlier assistant turn loses its think block ...
    assert "<|im_start|>assistant\n4<|im_end|>\n" in tok.render_chat(MULTI_TURN)
    # ... but an assistant turn after the last user message keeps it.
    last = MULTI_TURN[:3]
    assert tok.render_chat(last, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n"
    )


def test_render_bad_role_is_model_error(tiny):
    tok = Tokenizer.from_folder(tiny)
    with pytest.raises(ModelError, match="Unsupported role"):
        tok.render_chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(ModelError, match="system message"):
        tok.render_chat([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])


def test_render_prompt_encodes_with_specials(real):
    tok = Tokenizer.from_folder(real)
    ids = tok.encode(tok.render_chat(SYSTEM_USER))
    assert ids[0] == 248045 and ids.count(248046) == 2
    assert ids[-2] == 248068 and tok.decode(ids[-1:]) == "\n"  # the generation prompt's <think>


def test_chat_template_file_wins_and_jinja_env(tmp_path):
    # chat_template.jinja overrides tokenizer_config; tojson escapes neither HTML nor non-ASCII;
    # trim_blocks/lstrip_blocks drop the block lines' newlines and indents, as in transformers.
    from transformers import AutoTokenizer

    folder = _folder(tmp_path, 512, None)
    template = "{{ messages|tojson }}\n{% for m in messages %}\n    {% if m %}\n{{ m.role }}\n"
    template += "    {% endif %}\n{% endfor %}\n{{ eos_token }}"
    (folder / "chat_template.jinja").write_text(template)
    msgs = [{"role": "user", "content": "<b>中</b> & 'q'"}]
    got = Tokenizer.from_folder(folder).render_chat(msgs, add_generation_prompt=False)
    assert got == '[{"role": "user", "content": "<b>中</b> & \'q\'"}]\nuser\n<|im_end|>'
    hf = AutoTokenizer.from_pretrained(str(folder))
    assert got == hf.apply_chat_template(msgs, tokenize=False)


# ===== stream decoder =====


def _stream(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    dec = StreamDecoder(tok)
    outs = [dec.feed(i) for i in ids]
    return outs, dec.flush()


@pytest.mark.parametrize("name", ["emoji", "cjk", "mixed"])
def test_stream_equals_decode(folder, name):
    tok = Tokenizer.from_folder(folder)
    ids = tok.encode(TEXTS[name])
    # The split this guards against happens: single tokens decode to half characters, so a
    # per-token decode would print U+FFFD.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert "".join(tok.decode([i]) for i in ids) != TEXTS[name]
    outs, rest = _stream(tok, ids)
    assert "".join(outs) + rest == TEXTS[name]
    assert not any("\ufffd" in out for out in outs)
    assert "" in outs  # bytes were held back at least once


def test_stream_prints_early(tiny):
    tok = Tokenizer.from_folder(tiny)
    outs, rest = _stream(tok, tok.encode("hello 😀 world"))
    assert outs[0] != "" and rest == ""  # ASCII comes out at once; nothing is left at the end
    assert "😀" in outs


def test_stream_random_bytes_and_flush(tiny):
    # Lone and truncated UTF-8 sequences: U+FFFD must match decode(), including at the end.
    tok = Tokenizer.from_folder(tiny)
    byte_ids = [tok.backend.token_to_id(c) for c in pre_tokenizers.ByteLevel.alphabet()]
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice(byte_ids + list(range(512))) for _ in range(rng.randrange(1, 60))]
        outs, rest = _stream(tok, ids)
        assert "".join(outs) + rest == tok.decode(ids)
    ids = tok.encode("ab😀")[:-1]  # stream cut inside the emoji
    outs, rest = _stream(tok, ids)
    assert "".join(outs) == "ab" and rest == "\ufffd"


def test_stream_long_replacement_run(tiny):
    # More than MAX_PENDING ids that all end in U+FFFD, then a whole character split in bytes.
    tok = Tokenizer.from_folder(tiny)
    lead = tok.backend.token_to_id("\u00c3")  # byte 0xC3 (GPT-2 byte map keeps it as Ã)
    ids = [lead] * 50 + tok.encode("中文")
    outs, rest = _stream(tok, ids)
    assert "".join(outs) + rest == tok.decode(ids) == "\ufffd" * 50 + "中文"
    assert "\ufffd" in "".join(outs[:50])  # the run was let out before it ended


def test_stream_window_stays_small(tiny):
    tok = Tokenizer.from_folder(tiny)
    dec = StreamDecoder(tok)
    ids = tok.encode(TEXTS["cjk"] * 50)
    for i in ids:
        dec.feed(i)
        assert len(dec.ids) <= 8  # a few ids of context and pending bytes, not the history


# ===== load errors =====


def test_missing_or_corrupt_files(tmp_path, tiny):
    assert Tokenizer.from_folder(tiny).encode("ok")  # negative control: the valid folder loads
    folder = tmp_path / "m"
    write_synthetic_tokenizer(folder, 512)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="tokenizer.json"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(ModelError, match="tokenizer.json"):
        Tokenizer.from_folder(folder)
    write_synthetic_tokenizer(folder, 512)
    (folder / "tokenizer_config.json").write_text("not json")
    with pytest.raises(ModelError, match="tokenizer_config.json"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(ModelError, match="tokenizer_config.json"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelError, match="chat_template"):
        Tokenizer.from_folder(folder)


def test_generation_config_eos(tmp_path):
    folder = tmp_path / "g"
    write_synthetic_tokenizer(folder, 512)
    assert Tokenizer.from_folder(folder).eos_ids == {509, 507}
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [509, 3]}))
    assert Tokenizer.from_folder(folder).eos_ids == {509, 507, 3}
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_folder(folder).eos_ids == {509, 507, 7}
