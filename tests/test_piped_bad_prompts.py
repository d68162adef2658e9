"""Plain piped mode (no --json): a bad prompt is one `error:` line on stderr naming it and an
empty line in its reply's place; the other prompts are answered as without it, and the exit
status is 1 at the end. Each case has its control: the same input without the bad lines."""

from __future__ import annotations

import io
import json
import shutil
import sys

from ftchat.cli import main


def _main(argv, capsys, monkeypatch, stdin: bytes):
    capsys.readouterr()
    monkeypatch.delenv("FTCHAT_DEBUG", raising=False)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _errors(err: str) -> list[str]:
    assert "Traceback" not in err and "internal error" not in err, err
    return [ln for ln in err.splitlines() if ln.startswith("error: ")]


GOOD = [b"hello", b"what is 2+2?", b"bye"]
# a bad line of each kind, and the start of the error that names it (its line number in MIXED)
BAD = [
    (b'{"prompt": 3}', 'error: stdin line 2: "prompt" must be a string with some text in it'),
    (b"caf\xe9 au lait", "error: stdin line 5 is not UTF-8 text"),
    (b"word " * 80, "error: stdin line 6 has"),  # over the --context 64 below
    (b'{"prompt": "a\\ud800b"}', 'error: stdin line 7: "prompt"'),
    (b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
     "error: stdin line 8: the JSON is nested too deeply"),
]
# the lines (a blank one skipped), and per non-blank line the good prompt or None
MIXED = [GOOD[0], BAD[0][0], b"", GOOD[1], BAD[1][0], BAD[2][0], BAD[3][0], BAD[4][0], GOOD[2]]
PLACES = [GOOD[0], None, GOOD[1], None, None, None, None, GOOD[2]]


def test_bad_lines_are_errors_and_the_rest_is_answered(tiny_bf16, capsys, monkeypatch):
    argv = ["run", tiny_bf16, "-n", "3", "-c", "64", "--threads", "1"]
    code, out, err = _main(argv, capsys, monkeypatch, b"\n".join(MIXED) + b"\n")
    assert code == 1, err
    errors = _errors(err)
    assert len(errors) == len(BAD), err
    for line, (_, text) in zip(errors, BAD):
        assert line.startswith(text), (line, text)
    assert f"3 replies, {len(BAD)} failed" in err, err
    # control: the good lines alone, exit 0, the same replies at the same places
    code, ref, ref_err = _main(argv, capsys, monkeypatch, b"\n".join(GOOD) + b"\n")
    assert code == 0 and _errors(ref_err) == [] and "failed" not in ref_err, ref_err
    replies = iter(ref.split("\n")[:-1])
    assert out.split("\n")[:-1] == ["" if g is None else next(replies) for g in PLACES]


def test_an_empty_rendered_prompt_is_that_lines_error(tiny_bf16, tmp_path, capsys,
                                                      monkeypatch):
    model = shutil.copytree(tiny_bf16, tmp_path / "ck")
    cfg_file = model / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    # a template that renders nothing for one prompt (the control prompts render as before)
    cfg["chat_template"] = ("{% if messages[-1]['content'] != 'vanish' %}"
                            + cfg["chat_template"] + "{% endif %}")
    cfg_file.write_text(json.dumps(cfg))
    code, out, err = _main(["run", model, "-n", "2"], capsys, monkeypatch, b"hi\nvanish\nhi\n")
    errors = _errors(err)
    assert code == 1 and len(errors) == 1, err
    assert errors[0].startswith("error: stdin line 2 renders to no tokens"), err
    first, empty, last = out.split("\n")[:-1]
    assert empty == "" and first == last  # the same prompt, the same greedy reply
    code, out, err = _main(["run", model, "-n", "2"], capsys, monkeypatch, b"hi\nhi\n")
    assert code == 0 and _errors(err) == [], err  # control


def test_json_mode_and_batches_place_errors_alike(tiny_bf16, capsys, monkeypatch):
    # the same input under --json, and plain with --batch-size 4: errors at the same places
    argv = ["run", tiny_bf16, "-n", "2", "-c", "64", "--threads", "1"]
    stdin = b"\n".join(MIXED) + b"\n"
    code, out, err = _main([*argv, "--json"], capsys, monkeypatch, stdin)
    records = [json.loads(x) for x in out.splitlines()]
    assert code == 1 and [("error" in r) for r in records] == [g is None for g in PLACES]
    code, batched, err = _main([*argv, "--batch-size", "4"], capsys, monkeypatch, stdin)
    code1, plain, _ = _main(argv, capsys, monkeypatch, stdin)
    assert code == code1 == 1 and batched == plain and len(_errors(err)) == len(BAD), err


def test_a_bad_prompt_flag_is_still_the_runs_error(tiny_bf16, capsys, monkeypatch):
    argv = ["run", tiny_bf16, "-n", "2", "-c", "64", "-p"]
    code, out, err = _main([*argv, "word " * 80], capsys, monkeypatch, b"")
    assert code == 1 and out == "" and "failed" not in err, err  # no empty reply line
    assert len(_errors(err)) == 1 and "--prompt has" in err
    code, out, err = _main([*argv, "hi"], capsys, monkeypatch, b"")
    assert code == 0 and _errors(err) == [], err  # control
