"""Piped mode: each prompt answered as it arrives, Ctrl-C ends the last line cleanly,
empty prompts and other bad lines are that line's error (an empty reply line, an error object
under --json) while the other lines are answered, stop strings."""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import time

import pytest

from ftchat import engine
from ftchat.model.synth import write_checkpoint
from ftchat.session import Session
from ftchat.settings import Settings
from ftchat.ui.text import one_line
from tests.cli_harness import CLI, child_env, reply_ids
from tests.cli_harness import run_main as _main


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "run", *args, "--threads", "1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=child_env(drop=("FTCHAT_DEBUG",)))


def read_line(stream, timeout: float) -> bytes | None:
    """One line of `stream`, or None if none came within `timeout` seconds."""
    buf, end = b"", time.monotonic() + timeout
    fd = stream.fileno()
    while not buf.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1)
        if not chunk:
            return buf or None
        buf += chunk
    return buf


def one_error(code, out, err, *expected, stdout="", status=1):
    """One `error:` line, the last on stderr, holding every `expected` text; exit `status`
    (2: a usage error)."""
    assert code == status and out == stdout, (code, out, err)
    lines = err.splitlines()
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1], err
    assert "Traceback" not in err and "internal error" not in err
    for text in expected:
        assert text in errors[0], err
    return errors[0]


# ===== as it arrives =====


def test_first_reply_comes_before_the_second_line_exists(tiny_nvfp4):
    # `(echo hello; sleep 6; echo hi) | ftchat run`: before, the first reply came after EOF
    p = spawn(str(tiny_nvfp4), "--max-new-tokens", "4")
    try:
        p.stdin.write(b"hello\n")
        p.stdin.flush()
        first = read_line(p.stdout, 90)  # stdin stays open: no EOF, no second line yet
        assert first is not None and first.strip(), "no reply while the input was still open"
        p.stdin.write(b"hi\n")
        p.stdin.close()
        rest, err = p.stdout.read(), p.stderr.read()
        assert p.wait(60) == 0, err
    finally:
        p.kill()
        p.wait()
    s = Session.open(tiny_nvfp4, Settings())
    eos = s.tokenizer.eos_ids
    replies = [reply_ids(s, [{"role": "user", "content": q}], 4) for q in ("hello", "hi")]
    want = [one_line(s.tokenizer.decode([t for t in r if t not in eos])) for r in replies]
    assert [first.decode().rstrip("\n"), *rest.decode().splitlines()] == want
    assert b"2 replies" in err and b"Traceback" not in err


def test_batch_gathers_only_prompts_already_there(tiny_nvfp4, monkeypatch, capsys):
    # All lines present (a file): --batch-size 2 decodes them two by two, as before
    calls = []
    real = engine.decode

    def recording(dec, prompts, *args, **kwargs):
        calls.append(len(prompts))
        yield from real(dec, prompts, *args, **kwargs)

    monkeypatch.setattr(engine, "decode", recording)
    code, out, err = _main(["run", tiny_nvfp4, "--batch-size", "2", "--max-new-tokens", "2"],
                           capsys, monkeypatch, "a\nb\nc\n")
    assert code == 0 and len(out.splitlines()) == 3, err
    assert calls == [2, 1]


# ===== Ctrl-C =====


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    def no_eos(name, t):
        if name == "lm_head.weight":
            t = t.clone()
            t[[507, 509]] = 0
        return t

    return write_checkpoint(tmp_path_factory.mktemp("ck") / "endless", "tiny",
                            fmt="nvfp4-modelopt", seed=1, weights_fn=no_eos)


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_in_piped_mode_ends_the_last_line(endless, as_json):
    p = spawn(str(endless), "--max-new-tokens", "100000", *(["--json"] if as_json else []))
    try:
        p.stdin.write(b"hello\n")
        p.stdin.flush()
        if not as_json:  # the reply is streaming
            assert select.select([p.stdout.fileno()], [], [], 90)[0]
            time.sleep(0.5)
        else:  # loaded, then decoding for a while
            while b"loaded in" not in (read_line(p.stderr, 90) or b"loaded in"):
                pass
            time.sleep(1.5)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 130, err
    assert out.endswith(b"\n") and out.count(b"\n") == 1, out[-200:]  # before: no newline
    assert b"Traceback" not in err and b"[interrupted]" in err
    if as_json:
        obj = json.loads(out)
        assert obj["stop"] == "interrupted" and len(obj["tokens"]) >= 1


# ===== empty prompts and bad lines =====


def test_empty_prompt_flag_is_an_error(capsys, monkeypatch):
    for value in ("", "   "):
        one_error(*_main(["run", "--prompt", value], capsys, monkeypatch),
                  "--prompt", "expected a prompt with some text in it", status=2)


def test_empty_json_prompt_plain_is_that_lines_error(tiny_nvfp4, capsys, monkeypatch):
    code, out, err = _main(["run", tiny_nvfp4, "--max-new-tokens", "2"], capsys, monkeypatch,
                           'hello\n{"prompt": ""}\n')
    assert code == 1 and "Traceback" not in err, err
    assert [ln for ln in err.splitlines() if ln.startswith("error: ")] == [
        'error: stdin line 2: "prompt" is empty: give a prompt with some text in it']
    assert len(out.splitlines()) == 2 and out.endswith("\n\n")  # its reply line is empty


def test_bad_lines_under_json_are_error_objects(tiny_nvfp4, capsys, monkeypatch):
    lines = ['{"prompt": "hello"}', '{"prompt": ""}', '{"prompt": 3}', "not json {",
             '{"prompt": "hi", "top_k": 5}', '{"prompt": "what?"}']
    code, out, err = _main(["run", tiny_nvfp4, "--json", "--max-new-tokens", "3"], capsys,
                           monkeypatch, "\n".join(lines) + "\n")
    assert code == 1, err
    objs = [json.loads(line) for line in out.splitlines()]
    assert [o["index"] for o in objs] == list(range(6))  # one object per non-blank line
    assert "tokens" in objs[0] and "tokens" in objs[3] and "tokens" in objs[5]  # a plain line
    assert objs[1] == {"index": 1, "error": 'stdin line 2: "prompt" is empty: give a prompt '
                                            "with some text in it"}
    assert objs[2]["error"] == 'stdin line 3: "prompt" must be a string with some text in it'
    assert objs[4]["error"].startswith('stdin line 5: "top_k" applies to sampling')
    assert [ln for ln in err.splitlines() if ln.startswith("error: ")] == [
        "error: " + objs[i]["error"] for i in (1, 2, 4)]
    assert "Traceback" not in err


def test_a_bad_line_arriving_later_does_not_stop_a_plain_run(tiny_nvfp4):
    # lines that arrive after the start are checked as they come: a bad one is an empty reply
    # line and an error on stderr, the lines after it are answered, the exit status is 1
    p = spawn(str(tiny_nvfp4), "--max-new-tokens", "3")
    try:
        p.stdin.write(b"hello\n")
        p.stdin.flush()
        assert read_line(p.stdout, 90) is not None
        p.stdin.write(b'{"prompt": "x", "max_new_tokens": 0}\nanswered too\n')
        p.stdin.close()
        rest, err = p.stdout.read(), p.stderr.read().decode()
        assert p.wait(60) == 1
    finally:
        p.kill()
        p.wait()
    assert rest.startswith(b"\n") and len(rest.splitlines()) == 2, rest
    assert [ln for ln in err.splitlines() if ln.startswith("error: ")] == [
        'error: stdin line 2: "max_new_tokens" must be a positive integer'], err
    assert "2 replies, 1 failed" in err


# ===== stop strings =====


def test_stop_strings_end_replies_before_them(tiny_nvfp4, capsys, monkeypatch):
    s = Session.open(tiny_nvfp4, Settings())
    full = reply_ids(s, [{"role": "user", "content": "What is 2+2?"}], 12)
    text = s.tokenizer.decode(full)
    stop = text[4:6]  # a string from the middle of the greedy reply
    assert stop.strip() and text.find(stop) == 4, text
    code, out, err = _main(["run", tiny_nvfp4, "--max-new-tokens", "12", "--stop", stop,
                            "--stop", "never there"], capsys, monkeypatch, "What is 2+2?\n")
    assert code == 0, err
    assert out == one_line(text[:4]) + "\n"
    line = json.dumps({"prompt": "What is 2+2?", "stop": [stop]})
    code, out, err = _main(["run", tiny_nvfp4, "--max-new-tokens", "12", "--json"], capsys,
                           monkeypatch, line + "\n")
    obj = json.loads(out)
    assert code == 0 and obj["stop"] == "stop_string" and obj["text"] == text[:4]
    assert s.tokenizer.decode(obj["tokens"]).find(stop) >= 0  # ended at the token completing it
    assert len(obj["tokens"]) < len(full)


def test_stop_string_flag_must_not_be_empty(capsys, monkeypatch):
    one_error(*_main(["run", "--stop", "", "--prompt", "hi"], capsys, monkeypatch),
              "--stop", "a non-empty stop string", status=2)


# ===== the demo model's reply to "hi" =====


def test_demo_reply_to_hi_shows_no_think_tag(capsys, monkeypatch):
    # The shipped demo model answers "hi" with </think> twice; only the first was dropped
    from ftchat.resolve import SHIPPED_DEMO
    from ftchat.ui.chat import run_chat
    from ftchat.ui.panel import Screen

    # --repeat-penalty 1: the plain argmax, as Session.open below decodes (the demo's default
    # penalty, from its generation_config.json, keeps it from writing </think> twice)
    argv = ["run", "--max-new-tokens", "24", "--repeat-penalty", "1"]
    code, out, err = _main(argv, capsys, monkeypatch, "hi\n")
    assert code == 0, err
    assert out.startswith("```python") and "think>" not in out, out
    code, raw, err = _main([*argv, "--json"], capsys, monkeypatch, "hi\n")
    obj = json.loads(raw)
    # --json: the answer in "text", the (empty) think block in "reasoning", the exact reply in
    # "tokens" (the two </think> the model wrote are there)
    assert obj["text"].startswith("```python") and obj["reasoning"] == "", obj
    exact = Session.open(SHIPPED_DEMO, Settings()).tokenizer.decode(obj["tokens"][:-1])  # eos
    assert exact.startswith("</think>\n\n</think>") and exact.endswith(obj["text"]), exact
    s = Session.open(SHIPPED_DEMO, Settings(max_new_tokens=24))
    shown = io.StringIO()
    lines = iter(["hi"])

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    assert run_chat(s, Screen(shown, io.StringIO(), panel=False), None, read) == 0
    assert shown.getvalue().startswith("```python") and "think>" not in shown.getvalue()
