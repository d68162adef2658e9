"""The basics a llama-cli / ollama user expects: --version, short flags, a prompt
file, --threads, --quiet, help grouped and without type labels on switches, one name for the
audit interval."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ftchat import __version__
from tests.cli_harness import run_main as _main

FTCHAT = Path(sys.executable).parent / "ftchat"


def one_error(code, out, err, *expected, status=1):
    """One `error:` line holding every `expected` text; exit `status` (2: a usage error)."""
    assert code == status and out == "", (code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and "internal error" not in err
    for text in expected:
        assert text in lines[0], err


@pytest.fixture
def settings_of(monkeypatch):
    """The Settings `run` would start with (the UI is not started)."""
    seen = []

    def fake_run(model, settings, *args):
        seen.append(settings)
        return 0

    monkeypatch.setattr("ftchat.ui.run.run", fake_run)
    return seen


def test_version(capsys, monkeypatch):
    for flag in ("--version", "-V"):
        code, out, err = _main([flag], capsys, monkeypatch)
        assert (code, out, err) == (0, f"ftchat {__version__}\n", "")
    p = subprocess.run([str(FTCHAT), "-V"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TERM": "dumb"})
    assert (p.returncode, p.stdout, p.stderr) == (0, f"ftchat {__version__}\n", "")


def test_short_flags_mean_the_long_ones(tiny_nvfp4, capsys, monkeypatch, tmp_path):
    long = _main(["run", tiny_nvfp4, "--prompt", "hello", "--max-new-tokens", "5", "--context",
                  "64", "--threads", "1"], capsys, monkeypatch)
    short = _main(["run", tiny_nvfp4, "-p", "hello", "-n", "5", "-c", "64", "-t", "1"], capsys,
                  monkeypatch)
    assert long[0] == short[0] == 0, short[2]
    assert long[1] == short[1] and long[1].strip()
    assert "context 64" in short[2]
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello\n")  # the file's last newline is not part of the prompt
    from_file = _main(["run", tiny_nvfp4, "-f", prompt, "-n", "5", "-c", "64"], capsys,
                      monkeypatch)
    assert from_file[:2] == (0, long[1])
    code, out, err = _main(["run", "-h"], capsys, monkeypatch)
    assert code == 0 and "Usage: ftchat run" in out


def test_prompt_file_errors(tmp_path, capsys, monkeypatch):
    one_error(*_main(["run", "-f", tmp_path / "nope.txt"], capsys, monkeypatch),
              f"--file {tmp_path / 'nope.txt'}: no such file")
    one_error(*_main(["run", "-f", tmp_path], capsys, monkeypatch), "is a folder, not a file")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    one_error(*_main(["run", "-f", tmp_path / "latin1.txt"], capsys, monkeypatch),
              "not UTF-8 text")
    (tmp_path / "p.txt").write_text("hi")
    one_error(*_main(["run", "-f", tmp_path / "p.txt", "-p", "hi"], capsys, monkeypatch),
              "give --prompt or --file, not both", status=2)
    (tmp_path / "blank.txt").write_text("\n\n")
    # the file named, not "--prompt ''" (the flag the user did not give)
    one_error(*_main(["run", "-f", tmp_path / "blank.txt"], capsys, monkeypatch),
              f"--file {tmp_path / 'blank.txt'}: the file has no text", status=2)


def test_threads_sets_torch_threads(tiny_nvfp4, capsys, monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    code, out, err = _main(["run", tiny_nvfp4, "-p", "hi", "-n", "2", "--threads", "2"], capsys,
                           monkeypatch)
    assert code == 0 and calls == [2], err
    one_error(*_main(["run", "--threads", "0", "-p", "hi"], capsys, monkeypatch),
              "--threads 0: expected a positive integer", status=2)


def test_quiet_prints_the_reply_only(tiny_nvfp4, capsys, monkeypatch):
    code, out, err = _main(["run", tiny_nvfp4, "-p", "hi", "-n", "3"], capsys, monkeypatch)
    assert code == 0 and "loaded in" in err and "prompt eval" in err  # control
    code, quiet_out, err = _main(["run", tiny_nvfp4, "-p", "hi", "-n", "3", "--quiet"], capsys,
                                 monkeypatch)
    assert (code, quiet_out, err) == (0, out, "")
    code, out, err = _main(["run", "--quiet", "-n", "3"], capsys, monkeypatch, "hello\n")
    assert code == 0 and out.strip() and err == ""  # the demo model: no notice either


def _help(*argv: str) -> str:
    p = subprocess.run([str(FTCHAT), *argv, "--help"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "TERM": "dumb", "COLUMNS": "100"})
    assert p.returncode == 0 and p.stderr == "", p.stderr
    return p.stdout


def test_help_is_grouped_and_shows_no_bool_labels():
    text = _help("run")
    panels = [m.group(1) for m in re.finditer(r"╭─ (.+?) ─", text)]
    assert panels[-5:] == ["Generation", "Model and memory", "Kernels", "Offload tuning",
                           "Debug"], panels
    kernels = text[text.index("╭─ Kernels"):text.index("╭─ Offload tuning")]
    for flag in ("--kernels", "fused|torch", "--pdl", "--no-pdl"):
        assert flag in kernels, flag
    generation = text[text.index("╭─ Generation"):text.index("╭─ Model and memory")]
    for flag in ("--prompt", "-p", "--max-new-tokens", "-n", "--temp", "--seed", "--stop",
                 "--json", "--quiet"):
        assert flag in generation, flag
    assert text.index("--prompt") < text.index("--prefetch")  # the common ones first
    for doc in ("/clear", "/stats", '"prompt"', '"temperature"', '"stop"', "stop_string"):
        assert doc in text, doc  # chat commands and the JSON-lines format
    for command in ([], ["run"], ["verify"], ["audit"], ["bench"], ["synth"], ["info"]):
        assert "<bool>" not in _help(*command), command


def test_one_name_for_the_audit_interval(settings_of, capsys, monkeypatch):
    for command in ("run", "verify", "audit"):
        text = _help(command)
        assert "--audit-every" in text and "--every " not in text and "--audit " not in text
    code, _, err = _main(["run", "--audit-every", "8"], capsys, monkeypatch)
    code2, _, err2 = _main(["run", "--audit", "8"], capsys, monkeypatch)  # the old name, hidden
    assert code == code2 == 0, err + err2
    assert settings_of[0].audit_every == settings_of[1].audit_every == 8
    one_error(*_main(["run", "--audit-every", "-1"], capsys, monkeypatch),
              "--audit-every -1: expected a non-negative integer", status=2)
    one_error(*_main(["audit", "--audit-every", "0", "-p", "hi"], capsys, monkeypatch),
              "--audit-every 0: expected a positive integer", status=2)


def test_audit_command_takes_the_new_and_the_old_name(tiny_bf16, capsys, monkeypatch):
    import json

    base = ["audit", tiny_bf16, "-p", "hello", "--slots", "20", "--prefetch", "on", "-n", "9",
            "--device", "cpu", "--json"]
    for name in ("--audit-every", "--every"):
        code, out, err = _main([*base, name, "4"], capsys, monkeypatch)
        assert code == 0, err
        assert json.loads(out.splitlines()[-1])["audits"] == 8 // 4 + 1


def test_every_option_is_named_after_its_parameter():
    # typer 0.27 named an option declared by metavar alone after the metavar (`--ARMS`), so
    # `bench --arms` failed there: every option spells its flag out
    import typer

    from ftchat.cli import app

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        for p in command.params:
            if p.param_type_name == "option":
                flag = "--" + p.name.replace("_", "-")
                assert flag in p.opts, (name, p.name, p.opts)


@pytest.mark.parametrize("command", ["run", "verify", "audit", "bench"])
def test_kernel_choices_reach_the_settings(command, capsys, monkeypatch):
    # every command that takes engine flags takes the kernel choices; its driver is replaced by
    # one that records the settings it was given
    seen = []
    targets = {"run": "ftchat.ui.run.run", "verify": "ftchat.debug.verify_command.run_verify",
               "audit": "ftchat.debug.audit_command.run_audit",
               "bench": "ftchat.commands.bench_ui.run_bench"}
    monkeypatch.setattr(targets[command], lambda model, settings, *a, **k: seen.append(settings)
                        or 0)
    extra = ["-p", "hi"] if command in ("run", "audit") else []
    monkeypatch.setenv("FTCHAT_PDL", "1")
    for flags, want in (([], ("fused", True)), (["--kernels", "torch", "--no-pdl"],
                                                ("torch", False))):
        code, _, err = _main([command, *extra, "--device", "cpu", *flags], capsys, monkeypatch)
        assert code == 0, err
        assert (seen[-1].kernels, seen[-1].pdl) == want
    monkeypatch.setenv("FTCHAT_PDL", "0")  # the variable decides where no flag is given
    assert _main([command, *extra, "--device", "cpu"], capsys, monkeypatch)[0] == 0
    assert seen[-1].pdl is False
    one_error(*_main([command, *extra, "--kernels", "triton"], capsys, monkeypatch),
              "--kernels 'triton': expected fused or torch", status=2)
