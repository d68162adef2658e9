"""`ftchat audit` takes MODEL and prompts as `run` does: MODEL the one positional argument,
prompts from -p (repeatable), -f FILE or stdin. A prompt typed where MODEL goes, or after it, is a
usage error (exit 2) that says where prompts go, before anything loads; each case has the
corrected command as its control."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.cli_harness import run_main as _main

AUDIT = ["--slots", "20", "--prefetch", "on", "-n", "4", "--audit-every", "2", "--device",
         "cpu", "--json"]


def _usage_error(code, out, err) -> str:
    assert code == 2 and out == "", (code, out, err)
    assert "Traceback" not in err and "internal error" not in err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err  # nothing loaded
    return err


@pytest.mark.parametrize("command", ["audit", "run", "verify"])
def test_a_prompt_in_models_place(command, capsys, monkeypatch):
    err = _usage_error(*_main([command, "What is 2+2?"], capsys, monkeypatch))
    assert "'What is 2+2?': no such model folder, and not a Hugging Face repo id" in err
    # where a prompt goes, in the commands that take one
    assert ("--prompt/-p TEXT" in err) == (command != "verify"), err


@pytest.mark.parametrize("command", ["audit", "run", "verify"])
def test_a_prompt_after_the_model(command, tiny_bf16, capsys, monkeypatch):
    err = _usage_error(*_main([command, tiny_bf16, "What is 2+2?"], capsys, monkeypatch))
    assert "unexpected extra argument(s) (What is 2+2?)" in err
    assert ("MODEL is the only argument: give a prompt with --prompt/-p" in err) == (
        command != "verify"), err


def test_the_corrected_commands_run(tiny_bf16, tmp_path, capsys, monkeypatch):
    # controls of the two tests above: the prompt after -p, after -f, on stdin
    code, out, err = _main(["audit", tiny_bf16, "-p", "What is 2+2?", *AUDIT], capsys,
                           monkeypatch)
    assert code == 0 and json.loads(out)["prompts"] == 1, err
    (tmp_path / "p.txt").write_text("What is 2+2?\n")
    code, out, err = _main(["audit", tiny_bf16, "-p", "hi", "-f", tmp_path / "p.txt", *AUDIT],
                           capsys, monkeypatch)
    assert code == 0 and json.loads(out)["prompts"] == 2, err
    code, out, err = _main(["audit", tiny_bf16, *AUDIT], capsys, monkeypatch,
                           "What is 2+2?\n\nhi\n")
    assert code == 0 and json.loads(out)["prompts"] == 2, err
    code, out, err = _main(["run", tiny_bf16, "-p", "What is 2+2?", "-n", "2"], capsys,
                           monkeypatch)
    assert code == 0, err


def test_a_model_folder_with_a_space_in_its_name(tiny_bf16, tmp_path, capsys, monkeypatch):
    # the check refuses only a MODEL that names no file: a real folder with a space is a model
    model = shutil.copytree(tiny_bf16, tmp_path / "my model")
    code, out, err = _main(["audit", model, "-p", "hi", *AUDIT], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["prompts"] == 1, err


def test_audit_file_errors_name_the_file(tiny_bf16, tmp_path, capsys, monkeypatch):
    code, out, err = _main(["audit", tiny_bf16, "-f", tmp_path / "none.txt", *AUDIT], capsys,
                           monkeypatch)
    assert code == 1 and out == "" and err == f"error: --file {tmp_path / 'none.txt'}: no such " \
        "file\n", err


def test_no_prompt_says_every_way_to_give_one(tiny_bf16, capsys, monkeypatch):
    code, out, err = _main(["audit", tiny_bf16, *AUDIT], capsys, monkeypatch, "\n")
    assert code == 2 and out == "", err  # a usage error; a missing --file is 1 (above)
    assert err == ("error: no prompts: give them with --prompt/-p TEXT (repeatable), --file/-f "
                   "FILE or on stdin, one per line\n")
