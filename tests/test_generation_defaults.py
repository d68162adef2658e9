"""A model folder's generation_config.json gives `ftchat run` its sampling defaults, as
transformers' generate reads the file: repetition_penalty always, temperature / top_k / top_p /
min_p only with "do_sample": true. A flag (or a JSON line's key) beats the file; without either
the run is greedy. The shipped demo carries repetition_penalty 1.3, which stops its loops; with
it, `ftchat run` equals transformers' generate on the same folder, token for token."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ftchat.errors import ModelError
from ftchat.generation_defaults import generation_defaults
from ftchat.resolve import SHIPPED_DEMO
from tests.cli_harness import run_main as _main


def _with_generation(src, dst, **keys):
    """A copy of the checkpoint `src` whose generation_config.json also holds `keys`."""
    model = shutil.copytree(src, dst)
    path = model / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **keys}))
    return model


def _records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


# ===== reading the file =====


def test_generation_defaults_read_as_transformers_reads_them(tmp_path):
    def read(**cfg):
        (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
        return generation_defaults(tmp_path)

    assert generation_defaults(tmp_path) == {}  # no file
    assert read(do_sample=False) == {}
    # greedy (no do_sample): the penalty counts, the sampling keys do not
    assert read(repetition_penalty=1.3, temperature=0.6, top_k=20) == {"repeat_penalty": 1.3}
    assert read(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, min_p=0.05) == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05}
    # do_sample alone: transformers' own values (temperature 1, top-k 50, top-p 1)
    assert read(do_sample=True) == {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
    assert read(do_sample=True, top_k=None) == {"temperature": 1.0, "top_p": 1.0}


@pytest.mark.parametrize("cfg, named", [
    ({"repetition_penalty": 0}, "repetition_penalty=0"),
    ({"repetition_penalty": "high"}, "repetition_penalty='high'"),
    ({"do_sample": True, "top_p": 2}, "top_p=2"),
    ({"do_sample": True, "top_k": -1}, "top_k=-1"),
])
def test_a_bad_value_names_the_file_and_the_key(cfg, named, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="generation_config.json: " + named):
        generation_defaults(tmp_path)


def test_a_bad_value_is_one_error_line_before_loading(tiny_bf16, tmp_path, capsys, monkeypatch):
    model = _with_generation(tiny_bf16, tmp_path / "ck", repetition_penalty=-1)
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    assert code == 1 and out == "" and "Traceback" not in err, err
    assert err.splitlines() == [f"error: {model / 'generation_config.json'}: "
                                "repetition_penalty=-1: expected a positive number (1: no "
                                "penalty)"]
    # the same value as a flag is the user's usage error: exit 2, where the model's file is 1
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2", "--repeat-penalty", "-1"],
                           capsys, monkeypatch)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("error: --repeat-penalty -1") and "expected a positive number" in err


# ===== precedence: flag, then the file, then greedy =====


def test_the_files_penalty_is_the_default_and_a_flag_beats_it(tiny_bf16, tmp_path, capsys,
                                                              monkeypatch):
    run = ["run", "-p", "What is 2+2?", "-n", "12", "--json", "--threads", "1"]

    def tokens(model, *flags):
        code, out, err = _main([run[0], model, *run[1:], *flags], capsys, monkeypatch)
        assert code == 0, err
        reply = _records(out)[0]
        assert "seed" not in reply  # a penalty alone draws nothing: no seed to report
        return reply["tokens"], err

    plain, err = tokens(tiny_bf16)
    assert "generation_config" not in err
    # below 1 the "penalty" favours seen tokens: the random model repeats none by itself
    penalized, _ = tokens(tiny_bf16, "--repeat-penalty", "0.05")
    assert penalized != plain  # control: the penalty changes this reply
    model = _with_generation(tiny_bf16, tmp_path / "ck", repetition_penalty=0.05)
    got, err = tokens(model)
    assert got == penalized
    assert "ftchat: from the model's generation_config.json: --repeat-penalty 0.05" in err
    got, err = tokens(model, "--repeat-penalty", "1")  # the flag beats the file
    assert got == plain and "generation_config" not in err
    # a JSON line's key beats both; a line without one takes the file's
    lines = [{"prompt": "What is 2+2?"}, {"prompt": "What is 2+2?", "repeat_penalty": 1}]
    code, out, err = _main(["run", model, "-n", "12", "--json", "--threads", "1"], capsys,
                           monkeypatch, "".join(json.dumps(x) + "\n" for x in lines))
    assert code == 0 and [r["tokens"] for r in _records(out)] == [penalized, plain], err


def test_do_sample_in_the_file_samples_by_default(tiny_bf16, tmp_path, capsys, monkeypatch):
    run = ["-p", "What is 2+2?", "-n", "6", "--json", "--threads", "1"]
    model = _with_generation(tiny_bf16, tmp_path / "ck", do_sample=True, temperature=0.7,
                             top_k=20)
    code, out, err = _main(["run", model, *run], capsys, monkeypatch)
    assert code == 0 and "seed" in _records(out)[0], err  # only a sampled reply has a seed
    assert "--temp 0.7, --top-k 20" in err
    code, out, err = _main(["run", model, *run, "--temp", "0"], capsys, monkeypatch)
    assert code == 0 and "seed" not in _records(out)[0], err  # --temp 0: greedy again
    code, out, err = _main(["run", tiny_bf16, *run], capsys, monkeypatch)
    assert code == 0 and "seed" not in _records(out)[0], err  # control: no file, greedy


def test_a_model_that_samples_takes_sampling_flags_without_temp(tiny_bf16, tmp_path, capsys,
                                                                monkeypatch):
    # --top-k / --seed need sampling, and this model's file samples (temperature 0.7): they
    # are taken without --temp (they were refused as if decoding were greedy)
    run = ["-p", "What is 2+2?", "-n", "6", "--json", "--threads", "1"]
    model = _with_generation(tiny_bf16, tmp_path / "ck", do_sample=True, temperature=0.7,
                             top_k=20)

    def reply(*flags):
        code, out, err = _main(["run", model, *run, *flags], capsys, monkeypatch)
        assert code == 0, err
        return _records(out)[0]

    greedy = reply("--temp", "0")["tokens"]
    sampled = reply("--seed", "3")
    assert sampled["seed"] == 3 and sampled["tokens"] != greedy  # the file's top-k 20 samples
    assert reply("--seed", "3")["tokens"] == sampled["tokens"]  # the seed was taken
    # --top-k 1 keeps the likeliest token only: the flag beats the file's 20 and the sampled
    # reply is the greedy one
    assert reply("--top-k", "1", "--seed", "3")["tokens"] == greedy
    # controls: --temp 0 makes it greedy, and a model whose file does not sample: refused
    for argv in (["run", model, *run, "--top-k", "1", "--temp", "0"],
                 ["run", tiny_bf16, *run, "--top-k", "1"]):
        code, out, err = _main(argv, capsys, monkeypatch)
        assert code == 2 and out == "" and err == (
            "error: --top-k applies to sampling: give --temp above 0 too (decoding is greedy "
            "by default)\n"), err


# ===== the shipped demo =====


def test_the_demos_penalty_stops_its_loop(capsys, monkeypatch):
    run = ["run", "-n", "48", "--json", "--threads", "1"]
    code, out, err = _main(run, capsys, monkeypatch, "hello\n")
    reply = _records(out)[0]
    assert code == 0 and "--repeat-penalty 1.3" in err, err
    assert reply["stop"] == "eos" and "hello\nhello" not in reply["text"], reply["text"]
    # control: the plain argmax answers hello over and over until the limit
    code, out, err = _main([*run, "--repeat-penalty", "1"], capsys, monkeypatch, "hello\n")
    reply = _records(out)[0]
    assert reply["stop"] == "length" and reply["text"].count("hello\n") >= 10, reply["text"]


def test_the_demos_default_equals_transformers_generate(capsys, monkeypatch):
    from transformers import GenerationConfig

    from ftchat.model.tokenizer import Tokenizer
    from tests.reference import lowest_index_ties, reference_model

    gen = GenerationConfig.from_pretrained(SHIPPED_DEMO)  # what generate reads from the folder
    assert gen.repetition_penalty == 1.3 and not gen.do_sample
    tok = Tokenizer.from_folder(SHIPPED_DEMO)
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": "hello"}]))
    # transformers penalizes every earlier token, ftchat the last 64: the same while they fit
    n = 40
    assert len(prompt) + n <= 64
    ref = reference_model(SHIPPED_DEMO)
    with lowest_index_ties(), torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                           dtype=torch.long), generation_config=gen, max_new_tokens=n)
    theirs = out[0, len(prompt):].tolist()
    code, out, err = _main(["run", "-p", "hello", "-n", str(n), "--json", "--threads", "1"],
                           capsys, monkeypatch)
    assert code == 0 and _records(out)[0]["tokens"] == theirs, err
