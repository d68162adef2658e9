"""The shipped demo model (ftchat/models/demo, trained on the H200 by scripts/train_demo.py):
complete, small, loaded by transformers with no missing keys, equal to it token for token, and
the default of `ftchat run`, whose replies are learned text."""

from __future__ import annotations

import io
import json
import sys

import pytest

from ftchat.cli import main
from ftchat.engine import generate, load_model, resident_backend
from ftchat.model.tokenizer import Tokenizer
from ftchat.resolve import SHIPPED_DEMO, default_model_path
from tests.reference import reference_greedy, reference_model

# a prompt the fine-tuning never saw (scripts/demo_data.py CHAT_EXAMPLES)
NEW_PROMPT = "Write a function that multiplies two numbers."


def test_the_shipped_demo_is_complete_small_and_the_default(tmp_path):
    names = {p.name for p in SHIPPED_DEMO.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json"} <= names
    shards = set(json.loads((SHIPPED_DEMO / "model.safetensors.index.json").read_text())
                 ["weight_map"].values())
    assert shards and shards <= names
    assert sum(p.stat().st_size for p in SHIPPED_DEMO.iterdir()) <= 41e6  # the demo ships at ~40 MB
    cfg = json.loads((SHIPPED_DEMO / "config.json").read_text())["text_config"]
    assert cfg["num_experts"] >= 64 and cfg["num_experts_per_tok"] == 8 and cfg["hc_count"] == 4
    assert {"linear_attention", "indexed_attention"} <= set(cfg["layer_types"])
    assert default_model_path({"XDG_CACHE_HOME": str(tmp_path)}) == SHIPPED_DEMO


def test_the_shipped_demo_equals_transformers_greedy():
    ref = reference_model(SHIPPED_DEMO)  # asserts no missing or unexpected keys
    tok = Tokenizer.from_folder(SHIPPED_DEMO)
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": NEW_PROMPT}]))
    _, _, hf_tokens = reference_greedy(ref, prompt, 16)
    m = load_model(SHIPPED_DEMO)
    ours = [s.tokens[0] for s in generate(m, [prompt], 16, resident_backend(m))]
    assert ours == hf_tokens


@pytest.mark.parametrize("prompt, learned", [
    ("Write a function that adds two numbers.", "def add(a, b):"),  # a fine-tuning example
    (NEW_PROMPT, "```python\ndef "),  # not one: still a code reply (not a correct one)
])
def test_run_with_no_model_answers_with_learned_text(prompt, learned, tmp_path, monkeypatch,
                                                      capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    capsys.readouterr()
    code = main(["run", "--prompt", prompt, "--max-new-tokens", "40"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "trained" in err and "RANDOM" not in err
    assert learned in out
    assert not (tmp_path / "ftchat").exists()  # no random demo written
