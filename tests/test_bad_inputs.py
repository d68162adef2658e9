"""What a user can type, pipe or point at: a specific one-line error naming the input (exit 1;
2 for usage), no traceback, no "internal error", and no existing file changed; signals clean up
temporary output and restore the terminal.

Most cases call `main()` in-process (no torch start per case); stdio, signal and terminal cases
run the real CLI in a subprocess (a pseudo-terminal for chat). Each fault has its control: the
same command without the fault works, or SIGKILL (which nothing can catch) leaves the mess the
handled signals clean up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import termios
import time
from pathlib import Path

import pexpect
import pytest
import torch
from safetensors.torch import load_file, save_file

from ftchat.commands.bench_ui import bench_contexts
from ftchat.model.synth import write_checkpoint
from ftchat.ui.text import split_reasoning
from tests import cli_harness
from tests.cli_harness import (CLI, endless_checkpoint, local_modes, run, send_at_prompt, spawn,
                               wait_for_echo_off)
from tests.cli_harness import run_main as _main

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]")
ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """cli_harness.child_env without FTCHAT_DEBUG, ftchat imported from this tree."""
    return cli_harness.child_env(drop=("FTCHAT_DEBUG",), PYTHONPATH=str(ROOT), **extra)


def clean_error(code: int, err: str, *expected: str, status: int = 1) -> str:
    """Exit `status`, one `error:` line on stderr holding every `expected` text, no traceback."""
    assert code == status, (code, err)
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    for text in expected:
        assert text in lines[0], err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def copy_model(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    return endless_checkpoint(tmp_path_factory, "bf16")


# ===== nothing lost: result files =====


def test_record_routing_never_truncates_an_existing_file(tiny_bf16, tmp_path, capsys,
                                                         monkeypatch):
    doc = tmp_path / "config.json"
    doc.write_text('{"keep": true}\n')
    before = snapshot(tmp_path)
    code, out, err = _main(["run", tiny_bf16, "-p", "hi", "-n", "3", "--record-routing", doc],
                           capsys, monkeypatch)
    clean_error(code, err, f"--record-routing {doc}", "exists", "--force")
    assert snapshot(tmp_path) == before
    # control: --force replaces it, with the record, and leaves no temporary file
    code, out, err = _main(["run", tiny_bf16, "-p", "hi", "-n", "3", "--record-routing", doc,
                            "--force"], capsys, monkeypatch)
    assert code == 0, err
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    assert json.loads(doc.read_text().splitlines()[0])["step"] == 1


def test_record_routing_never_replaces_a_file_of_the_model(tiny_bf16, tmp_path, capsys,
                                                          monkeypatch):
    model = copy_model(tiny_bf16, tmp_path / "ck")
    before = snapshot(model)
    for target in (model / "config.json", model / "sub" / ".." / "tokenizer.json"):
        (model / "sub").mkdir(exist_ok=True)
        code, out, err = _main(["run", model, "-p", "hi", "-n", "2", "--record-routing", target,
                                "--force"], capsys, monkeypatch)
        # before: --force replaced the model's own config.json with the record
        clean_error(code, err, f"--record-routing {target}", "a file of the model folder")
        (model / "sub").rmdir()
        assert snapshot(model) == before
    # control: a new file there is no file of the model; --force outside it replaces
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2", "--record-routing",
                            model / "trace.jsonl"], capsys, monkeypatch)
    assert code == 0 and (model / "trace.jsonl").is_file(), err
    (tmp_path / "old.jsonl").write_text("old\n")
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2", "--record-routing",
                            tmp_path / "old.jsonl", "--force"], capsys, monkeypatch)
    assert code == 0 and (tmp_path / "old.jsonl").read_text() != "old\n", err


def test_record_routing_of_a_failed_run_leaves_no_file(tiny_bf16, tmp_path, capsys, monkeypatch):
    trace = tmp_path / "trace.jsonl"
    long_prompt = "word " * 200
    code, out, err = _main(["run", tiny_bf16, "-p", long_prompt, "-c", "64", "-n", "3",
                            "--record-routing", trace], capsys, monkeypatch)
    clean_error(code, err, "--prompt", "more than the context (64)")
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary name
    code, out, err = _main(["run", tiny_bf16, "-p", "hi", "-c", "64", "-n", "3",
                            "--record-routing", trace], capsys, monkeypatch)  # control
    assert code == 0, err
    assert [p.name for p in tmp_path.iterdir()] == ["trace.jsonl"]


def test_record_routing_of_a_refused_setting_leaves_no_file(tiny_bf16, tmp_path, capsys,
                                                            monkeypatch):
    trace = tmp_path / "trace.jsonl"  # the budget is checked once the backend is built
    code, out, err = _main(["run", tiny_bf16, "-p", "hi", "-n", "2", "--prefetch", "on",
                            "--budget", "1000000000", "--record-routing", trace], capsys,
                           monkeypatch)
    clean_error(code, err, "--budget-gdn 1000000000", status=2)
    assert list(tmp_path.iterdir()) == []


def test_record_routing_refuses_a_device_or_fifo_even_with_force(tiny_bf16, tmp_path, capsys,
                                                                 monkeypatch):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for target in (fifo, Path(os.devnull)):
        code, out, err = _main(["run", tiny_bf16, "-p", "hi", "-n", "2", "--record-routing",
                                target, "--force"], capsys, monkeypatch)
        clean_error(code, err, str(target), "not a regular file")
    assert Path(os.devnull).is_char_device() and fifo.is_fifo()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT", "SIGKILL"])
def test_a_signal_during_synth_removes_its_temporary_folder(tmp_path, sig):
    """SIGKILL is the control: nothing can clean up after it, and the check sees the leftover."""
    out = tmp_path / "ck"
    p = subprocess.Popen([*CLI, "synth", str(out), "--preset", "flash-next", "--layers", "2"],
                         env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".synth-*")):  # the write has started
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.02)
        p.send_signal(getattr(signal, sig))
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    left = list(tmp_path.iterdir())
    if sig == "SIGKILL":
        assert p.returncode == -signal.SIGKILL and [x.name[:7] for x in left] == [".synth-"]
        return
    assert left == [], left
    assert p.returncode == (130 if sig == "SIGINT" else 128 + getattr(signal, sig))
    assert "Traceback" not in err and "internal error" not in err, err


# ===== nothing lost: the chat terminal =====


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGKILL"])
def test_a_signal_during_a_chat_reply_restores_the_terminal(endless, tmp_path, sig):
    """While a reply streams, echo and line mode are off. SIGTERM/SIGHUP restore them (a new
    pty has both on) and drop the routing record's temporary file; SIGKILL (the control)
    leaves both behind."""
    trace = tmp_path / "trace.jsonl"
    child = spawn([*CLI[1:], "run", str(endless), "--threads", "1", "--no-panel", "-n", "400",
                   "--record-routing", str(trace)], child_env(TERM="xterm"))
    try:
        # (at the prompt readline has the terminal in its own mode)
        send_at_prompt(child, "hello")
        child.expect(r"\S")  # the reply streams
        wait_for_echo_off(child)  # echo goes off for the reply
        child.kill(getattr(signal, sig))
        child.expect(pexpect.EOF)
        modes = local_modes(child.child_fd)  # the pty keeps the modes its last user left
        tail = child.before
    finally:
        child.close(force=True)
    left = [p.name for p in tmp_path.iterdir()]
    if sig == "SIGKILL":
        assert not modes & termios.ECHO and len(left) == 1 and left[0].endswith(".tmp")
        return
    assert modes & termios.ECHO and modes & termios.ICANON
    assert left == [] and "Traceback" not in tail
    assert child.signalstatus is None and child.exitstatus == 128 + getattr(signal, sig)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_signal_at_the_chat_prompt_restores_the_terminal(endless, sig):
    """At the prompt the line editor has echo and line mode off; SIGTERM unwinds through it
    and they come back; SIGKILL (the control) leaves them off."""
    child = spawn([*CLI[1:], "run", str(endless), "--threads", "1", "--no-panel"],
                  child_env(TERM="xterm"))
    try:
        child.expect_exact(">>> ")
        wait_for_echo_off(child)  # the line editor has taken the terminal
        child.kill(getattr(signal, sig))
        child.expect(pexpect.EOF)
        modes = local_modes(child.child_fd)
    finally:
        child.close(force=True)
    restored = bool(modes & termios.ECHO and modes & termios.ICANON)
    assert restored == (sig != "SIGKILL")


# ===== bounds before work =====


def test_threads_beyond_the_machine(tiny_bf16, capsys, monkeypatch):
    code, out, err = _main(["run", tiny_bf16, "-p", "hi", "--threads", "100000"], capsys,
                           monkeypatch)
    clean_error(code, err, "--threads 100000", "CPU", status=2)
    assert "loaded" not in err  # refused before the model loads
    code, out, err = _main(["run", tiny_bf16, "-p", "hi", "-n", "2", "--threads", "1"], capsys,
                           monkeypatch)
    assert code == 0, err  # control


def test_layers_out_of_range(tmp_path, capsys, monkeypatch):
    t = time.monotonic()
    code, out, err = _main(["info", "--synthetic", "tiny", "--layers", "100000000"], capsys,
                           monkeypatch)
    clean_error(code, err, "--layers 100000000", "2 to 512", status=2)
    assert time.monotonic() - t < 30  # before: ran unbounded
    code, out, err = _main(["synth", tmp_path / "zero", "--layers", "0"], capsys, monkeypatch)
    clean_error(code, err, "--layers 0", status=2)
    assert list(tmp_path.iterdir()) == []  # before: wrote 6 layers
    code, out, err = _main(["synth", tmp_path / "two", "--layers", "2"], capsys, monkeypatch)
    assert code == 0, err  # control
    cfg = json.loads((tmp_path / "two" / "config.json").read_text())
    assert cfg["text_config"]["num_hidden_layers"] == 2


def test_a_huge_top_k_is_every_token(tiny_bf16, capsys, monkeypatch):
    runs = []
    for k in ("99999999999999999999", "0"):  # 0: off, the control
        code, out, err = _main(["run", tiny_bf16, "-p", "hi", "-n", "6", "--json", "--temp", "1",
                                "--seed", "5", "--top-k", k], capsys, monkeypatch)
        assert code == 0 and "internal error" not in err, err
        runs.append(json.loads(out)["tokens"])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("argv, named", [
    (["info", "--vram", "inf"], "--vram inf"),
    (["info", "--vram", "nan"], "--vram nan"),
    (["run", "-p", "hi", "--vram-budget", "inf"], "--vram-budget"),
    (["run", "-p", "hi", "--expert-vram", "nan"], "--expert-vram"),
    (["serve", "--cache-ram", "nan"], "--cache-ram nan"),
    (["serve", "--cache-ram", "inf"], "--cache-ram inf"),
])
def test_vram_not_a_finite_number(tiny_bf16, capsys, monkeypatch, argv, named):
    code, out, err = _main([argv[0], tiny_bf16, *argv[1:]], capsys, monkeypatch)
    clean_error(code, err, named, status=2)


@pytest.mark.parametrize("argv, named", [
    (["run", "-p", "hi", "--expert-vram", "1e300"], "--expert-vram"),  # its bytes overflow
    (["run", "-p", "hi", "--batch-size", "100000000"], "--batch-size 100000000"),
    (["run", "-p", "hi", "--prefetch", "on", "--budget", "1000000000"], "--budget-gdn"),
    (["info", "--batch-size", "99999999999"], "--batch-size 99999999999"),  # MemoryError
])
def test_numbers_out_of_range(tiny_bf16, capsys, monkeypatch, argv, named):
    code, out, err = _main([argv[0], tiny_bf16, *argv[1:]], capsys, monkeypatch)
    clean_error(code, err, named, status=2)


def test_graph_on_the_cpu(tiny_bf16, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("--graph is refused only where there is no CUDA device")
    for argv in (["run", tiny_bf16, "-p", "hi", "--graph"],
                 ["bench", tiny_bf16, "--graph", "--steps", "1", "--rounds", "1"]):
        code, out, err = _main(argv, capsys, monkeypatch)
        clean_error(code, err, "--graph", "CPU", status=2)
    code, out, err = _main(["run", tiny_bf16, "-p", "hi", "-n", "2", "--eager"], capsys,
                           monkeypatch)
    assert code == 0, err  # control


@pytest.mark.parametrize("argv, named, status", [
    (["-n", "0", "-p", "hi"], "--max-new-tokens 0", 2),
    (["-p", ""], "prompt 1 is empty", 2),
    (["-p", "   "], "prompt 1 is empty", 2),
    (["-n", "5000", "-p", "hi"], "--max-new-tokens 5000: with prompt 1's", 2),  # the flag's
    (["-c", "16", "-p", "hello " * 20], "prompt 1 has", 1),  # the prompt alone: a runtime error
])
def test_audit_bounds(tiny_bf16, capsys, monkeypatch, argv, named, status):
    code, out, err = _main(["audit", tiny_bf16, *argv], capsys, monkeypatch)
    clean_error(code, err, named, status=status)
    assert "audits" not in out


def test_a_huge_prompt_is_refused_by_its_bytes_before_tokenizing(tiny_bf16, capsys,
                                                                 monkeypatch):
    line = "x" * 4_000_000
    code, out, err = _main(["run", tiny_bf16, "-c", "256", "-n", "2"], capsys, monkeypatch,
                           line + "\n")
    # "bytes, at least N tokens": the byte bound refused it (a tokenized one says "has N tokens")
    clean_error(code, err, "stdin line 1 is 4,000,000 bytes", "more than the context (256)")
    code, out, err = _main(["run", tiny_bf16, "-c", "256", "-n", "2"], capsys, monkeypatch,
                           "x" * 300 + "\n")  # control: a line near the context is tokenized
    clean_error(code, err, "stdin line 1 has", "tokens, more than the context (256)")


def test_bench_defaults_fit_the_models_positions():
    assert bench_contexts(None, 4096, 4 * 32) == [4096 - 4 * 32 - 2]  # the demo: 4,096
    assert bench_contexts(None, 262144, 4 * 32) == [4096]
    with pytest.raises(Exception, match="--context 4096: .* exceeds the model's 4096"):
        bench_contexts([4096], 4096, 4 * 32)
    assert bench_contexts([4096 - 4 * 32 - 2], 4096, 4 * 32)  # control: the largest that fits


def test_bench_without_a_context_runs_on_the_demo_model(capsys, monkeypatch):
    code, out, err = _main(["bench", "--steps", "2", "--rounds", "1", "--arms", "off",
                            "--threads", "1"], capsys, monkeypatch)
    assert code == 0 and "context 4090" in out, err  # 4096 - (1 + 1) x 2 - 2


def test_bench_shows_its_rounds_on_a_terminal_only(tiny_bf16):
    argv = ["bench", str(tiny_bf16), "--steps", "2", "--rounds", "2", "--arms", "off",
            "--threads", "1"]
    child = spawn([*CLI[1:], *argv], child_env(TERM="xterm"), columns=120)
    try:
        child.expect(pexpect.EOF)
        drawn = ANSI.sub("", child.before)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0 and "context 4088: rounds" in drawn, drawn
    p = run([*CLI, *argv], child_env())  # control: stderr a pipe, no bar
    assert p.returncode == 0 and "rounds" not in p.stderr, p.stderr


# ===== bad text =====


def test_invalid_utf8_on_stdin_is_that_lines_error(tiny_bf16, capsys, monkeypatch):
    code, out, err = _main(["run", tiny_bf16, "-n", "2", "--json"], capsys, monkeypatch,
                           b"hi\xff\nhello\n")
    clean_error(code, err, "stdin line 1", "not UTF-8")
    records = [json.loads(x) for x in out.splitlines()]
    assert "error" in records[0] and records[1]["index"] == 1 and "tokens" in records[1]


def test_audit_stdin_not_utf8_names_its_line(tiny_bf16, capsys, monkeypatch):
    code, out, err = _main(["audit", tiny_bf16, "-n", "2"], capsys, monkeypatch,
                           b"hi\ncaf\xe9\n")
    # before: "the text is not valid Unicode: ... at character 18" (of the rendered template)
    clean_error(code, err, "stdin line 2 is not UTF-8 text", "0xe9")
    code, out, err = _main(["audit", tiny_bf16, "-n", "2", "--json"], capsys, monkeypatch,
                           "hi\ncaf\u00e9\n".encode())
    assert code == 0 and json.loads(out)["prompts"] == 2, err  # control: the same in UTF-8


def test_audit_endless_stdin_without_a_line_break(tiny_bf16):
    with open("/dev/zero", "rb") as zero:  # before: read whole into memory, a MemoryError here
        p = run([*CLI, "audit", str(tiny_bf16), "-n", "2"], child_env(), stdin=zero,
                preexec_fn=_memory_cap(8))
    clean_error(p.returncode, p.stderr, "stdin line 1 is longer than 256 MiB")
    p = run([*CLI, "audit", str(tiny_bf16), "-n", "2"], child_env(), input="hi\n",
            preexec_fn=_memory_cap(8))
    assert p.returncode == 0, p.stderr  # control


def test_a_lone_surrogate_in_a_json_prompt(tiny_bf16, capsys, monkeypatch):
    stdin = '{"prompt": "a\\ud800b"}\n{"prompt": "x", "stop": ["\\udfff"]}\nhello\n'
    code, out, err = _main(["run", tiny_bf16, "-n", "2", "--json"], capsys, monkeypatch, stdin)
    assert code == 1 and "Traceback" not in err and "internal error" not in err, err
    records = [json.loads(x) for x in out.splitlines()]
    assert 'stdin line 1: "prompt"' in records[0]["error"] and "U+D800" in records[0]["error"]
    assert 'stdin line 2: "stop"' in records[1]["error"]
    assert records[2]["index"] == 2 and "tokens" in records[2]  # the rest still runs


def test_a_lone_surrogate_in_an_argument(tiny_bf16, capsys, monkeypatch):
    code, out, err = _main(["run", tiny_bf16, "-n", "2", "-p", "a\udcffb"], capsys, monkeypatch)
    clean_error(code, err, "--prompt", "not UTF-8", status=2)


def test_deeply_nested_json(tiny_bf16, capsys, monkeypatch):
    nested = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    code, out, err = _main(["run", tiny_bf16, "-n", "2", "--json"], capsys, monkeypatch,
                           nested + "\nhello\n")
    clean_error(code, err, "stdin line 1", "nested too deeply")
    records = [json.loads(x) for x in out.splitlines()]
    assert "error" in records[0] and "tokens" in records[1]


def test_a_json_number_with_too_many_digits(tiny_bf16, capsys, monkeypatch):
    line = '{"prompt": "hi", "seed": ' + "9" * 5000 + "}"
    code, out, err = _main(["run", tiny_bf16, "-n", "2", "--json"], capsys, monkeypatch,
                           line + "\nhello\n")
    message = clean_error(code, err, "stdin line 1", "invalid JSON", "too many digits")
    assert "sys." not in message  # not Python's advice to raise its limit
    records = [json.loads(x) for x in out.splitlines()]
    assert "error" in records[0] and "tokens" in records[1]  # control: the next line runs


def test_serve_on_a_taken_port(tiny_bf16, capsys, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = _main(["serve", tiny_bf16, "--port", port, "--threads", "1"], capsys,
                               monkeypatch)
    clean_error(code, err, f"--port {port}", "in use")  # before: uvicorn's log line, exit 3
    assert "model loading" not in err  # refused before the model loads
    code, out, err = _main(["serve", tiny_bf16, "--host", "no.such.host.invalid", "--port",
                            port], capsys, monkeypatch)
    clean_error(code, err, "--host no.such.host.invalid")


@pytest.mark.parametrize("key", ["", " key", "key\n"])
def test_serve_refuses_a_key_no_client_could_send(tiny_bf16, capsys, monkeypatch, key):
    with socket.socket() as taken:  # were the key taken, serve stops at the port, not serving
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, out, err = _main(["serve", tiny_bf16, "--api-key", key, "--port",
                                taken.getsockname()[1]], capsys, monkeypatch)
    clean_error(code, err, "API key", repr(key), status=2)  # before: every request got 401


def test_one_prompt_over_the_context_does_not_abort_the_batch(tiny_bf16, capsys, monkeypatch):
    stdin = "hello\n" + "word " * 100 + "\nhi\n"
    code, out, err = _main(["run", tiny_bf16, "-n", "2", "--json", "-c", "64", "--batch-size",
                            "3"], capsys, monkeypatch, stdin)
    clean_error(code, err, "stdin line 2 has", "more than the context (64)")
    records = [json.loads(x) for x in out.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert "tokens" in records[0] and "error" in records[1] and "tokens" in records[2]


def test_an_empty_chat_template(tiny_bf16, tmp_path, capsys, monkeypatch):
    model = copy_model(tiny_bf16, tmp_path / "ck")
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    assert code == 0, err  # control
    cfg_file = model / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = ""
    cfg_file.write_text(json.dumps(cfg))
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    clean_error(code, err, str(cfg_file), "chat_template is empty")


# ===== paths =====


def test_a_fifo_in_the_model_folder(tiny_bf16, tmp_path):
    model = copy_model(tiny_bf16, tmp_path / "ck")
    (model / "generation_config.json").unlink()
    os.mkfifo(model / "generation_config.json")
    # before: blocked forever
    p = run([*CLI, "run", str(model), "-p", "hi", "-n", "2"], child_env())
    clean_error(p.returncode, p.stderr, "generation_config.json", "not a regular file")


def test_endless_input_without_a_line_break(tiny_bf16, capsys, monkeypatch):
    with open("/dev/zero", "rb") as zero:  # before: read into memory until it ran out
        p = run([*CLI, "run", str(tiny_bf16), "-n", "2"], child_env(), stdin=zero)
    clean_error(p.returncode, p.stderr, "stdin line 1 is longer than 256 MiB")
    code, out, err = _main(["run", tiny_bf16, "-f", "/dev/zero"], capsys, monkeypatch)
    clean_error(code, err, "--file /dev/zero", "a device")


# ===== checkpoints checked at load =====


def _rewrite_tensor(model: Path, name: str, change) -> None:
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    shard = model / index[name]
    tensors = load_file(shard)
    tensors[name] = change(tensors[name])
    save_file(tensors, shard, metadata={"format": "pt"})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_dense_weights(tiny_bf16, tmp_path, capsys, monkeypatch, value):
    model = copy_model(tiny_bf16, tmp_path / "ck")
    name = "model.language_model.layers.1.linear_attn.out_proj.weight"

    def damage(t):
        t = t.clone()
        t[3, 5] = value
        return t

    _rewrite_tensor(model, name, damage)
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    clean_error(code, err, name, "NaN or Inf")
    code, out, err = _main(["run", tiny_bf16, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    assert code == 0, err  # control: the undamaged checkpoint


def test_integer_storage_of_float_weights(tiny_bf16, tmp_path, capsys, monkeypatch):
    model = copy_model(tiny_bf16, tmp_path / "ck")
    name = "model.language_model.layers.1.linear_attn.out_proj.weight"
    _rewrite_tensor(model, name, lambda t: t.to(torch.int16))
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    clean_error(code, err, name, "int16", "floating-point")


def test_config_with_fewer_layers_than_the_tensors(tiny_bf16, tmp_path, capsys, monkeypatch):
    model = copy_model(tiny_bf16, tmp_path / "ck")
    path = model / "config.json"
    cfg = json.loads(path.read_text())
    text = cfg["text_config"]
    text["num_hidden_layers"] = 4
    text["layer_types"] = text["layer_types"][:4]
    path.write_text(json.dumps(cfg))
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    clean_error(code, err, str(path), "num_hidden_layers is 4", "layers 0 to 5")


def test_tokenizer_ids_beyond_the_vocabulary(tiny_bf16, tmp_path, capsys, monkeypatch):
    model = copy_model(tiny_bf16, tmp_path / "ck")
    path = model / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["added_tokens"].append({"id": 700, "content": "<|beyond|>", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False,
                                "special": True})
    path.write_text(json.dumps(tok))
    code, out, err = _main(["run", model, "-p", "hi <|beyond|>", "-n", "2"], capsys,
                           monkeypatch)
    # tokenizers numbers an added token past the vocabulary's end: 512 of a 512-row embedding
    clean_error(code, err, str(path), "ids go up to 512", "vocab_size) has 512")


@pytest.mark.parametrize("index", [[], {"weight_map": "model.safetensors"}, "weight_map=5"])
def test_an_index_of_the_wrong_shape(tiny_bf16, tmp_path, capsys, monkeypatch, index):
    model = copy_model(tiny_bf16, tmp_path / "ck")
    path = model / "model.safetensors.index.json"
    good = json.loads(path.read_text())
    if index == "weight_map=5":  # every file name a number
        index = {"weight_map": {name: 5 for name in good["weight_map"]}}
    path.write_text(json.dumps(index))
    for argv in (["run", model, "-p", "hi", "-n", "2"], ["info", model]):
        code, out, err = _main(argv, capsys, monkeypatch)  # before: internal error (TypeError)
        clean_error(code, err, str(path), "weight_map")
    path.write_text(json.dumps(good))
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    assert code == 0, err  # control: the same folder with its index back


@pytest.mark.parametrize("escape", ["parent", "absolute"])
def test_an_index_naming_a_shard_outside_the_model(tiny_bf16, tmp_path, capsys, monkeypatch,
                                                   escape):
    model = copy_model(tiny_bf16, tmp_path / "ck")
    path = model / "model.safetensors.index.json"
    good = json.loads(path.read_text())
    shard = sorted(set(good["weight_map"].values()))[0]
    (tmp_path / shard).write_bytes((model / shard).read_bytes())  # the same bytes, beside it
    name = f"../{shard}" if escape == "parent" else str(tmp_path / shard)
    path.write_text(json.dumps({"weight_map": {k: name if f == shard else f
                                               for k, f in good["weight_map"].items()}}))
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    # before: read the file outside the folder without a word
    clean_error(code, err, str(path), f"the shard {name!r} is outside the model folder")
    path.write_text(json.dumps(good))
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    assert code == 0, err  # control: the same folder with its own index


@pytest.mark.parametrize("where, qc", [("config.json", "nvfp4"), ("config.json", [1]),
                                       ("hf_quant_config.json", []),
                                       ("hf_quant_config.json", {"quantization": 5})])
def test_a_quantization_config_that_is_not_an_object(tiny_nvfp4, tmp_path, capsys, monkeypatch,
                                                     where, qc):
    model = copy_model(tiny_nvfp4, tmp_path / "ck")
    cfg = json.loads((model / "config.json").read_text())
    modelopt = cfg.pop("quantization_config")
    if where == "config.json":
        cfg["quantization_config"] = qc
    else:
        (model / where).write_text(json.dumps(qc))
    (model / "config.json").write_text(json.dumps(cfg))
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    clean_error(code, err, str(model / where))  # before: internal error (AttributeError)
    # control: hf_quant_config.json in its real form ({"quantization": the ModelOpt fields})
    (model / "hf_quant_config.json").write_text(json.dumps({"quantization": {
        k: v for k, v in modelopt.items() if k != "quant_method"}}))
    cfg.pop("quantization_config", None)
    (model / "config.json").write_text(json.dumps(cfg))
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    assert code == 0, err


@pytest.mark.parametrize("template, named", [
    ("{% for i in range(10**9) %}x{% endfor %}", "OverflowError"),  # past the sandbox's range
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ 1 + 'a' }}", "TypeError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
])
def test_a_chat_template_that_fails_in_python(tiny_bf16, tmp_path, capsys, monkeypatch,
                                              template, named):
    model = copy_model(tiny_bf16, tmp_path / "ck")
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    assert code == 0, err  # control: the model's own template
    cfg_file = model / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = template
    cfg_file.write_text(json.dumps(cfg))
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    clean_error(code, err, "chat template failed", named)  # before: internal error


def test_a_non_finite_logit_stops_the_decode(tiny_bf16, tmp_path, capsys, monkeypatch):
    """Finite weights whose product overflows: the load check passes, the decode must not."""

    def huge_head(name, t):
        return t.sign() * 3.0e38 if name == "lm_head.weight" else t

    model = write_checkpoint(tmp_path / "overflow", "tiny", fmt="bf16", seed=0,
                             weights_fn=huge_head)
    code, out, err = _main(["run", model, "-p", "hi", "-n", "4"], capsys, monkeypatch)
    clean_error(code, err, "NaN or Inf", "position")
    code, out, err = _main(["run", tiny_bf16, "-p", "hi", "-n", "4"], capsys, monkeypatch)
    assert code == 0, err  # control: the same prompt on finite logits


# ===== standard streams =====


def _closing(fd: int):
    return lambda: os.close(fd)


def test_stdout_on_a_full_device(tiny_bf16):
    with open("/dev/full", "w") as full:
        p = subprocess.run([*CLI, "run", str(tiny_bf16), "-p", "hi", "-n", "3", "--quiet"],
                           env=child_env(), stdout=full, stderr=subprocess.PIPE, text=True,
                           timeout=120)
    clean_error(p.returncode, p.stderr, "cannot write to stdout", "No space left")
    assert "Exception ignored" not in p.stderr


def test_closed_stdout(tiny_bf16):
    p = subprocess.run([*CLI, "run", str(tiny_bf16), "-p", "hi", "-n", "3"], env=child_env(),
                       stderr=subprocess.PIPE, text=True, timeout=120,
                       preexec_fn=_closing(1))
    clean_error(p.returncode, p.stderr, "stdout is closed")


def test_closed_stdin(tiny_bf16):
    p = run([*CLI, "run", str(tiny_bf16), "-n", "3"], child_env(), preexec_fn=_closing(0))
    assert p.returncode == 0 and "no prompts on stdin" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_closed_stderr_keeps_errors_out_of_stdout(tiny_bf16):
    argv = [*CLI, "run", str(tiny_bf16), "-p", "hi", "--threads", "0"]
    p = subprocess.run(argv, env=child_env(), stdout=subprocess.PIPE, text=True, timeout=120,
                       preexec_fn=_closing(2))
    assert p.returncode == 2 and p.stdout == ""  # before: the error was printed into stdout
    p = run(argv, child_env())
    # control: stderr open, the error is there
    clean_error(p.returncode, p.stderr, "--threads 0", status=2)


# ===== at 80 columns =====


@pytest.mark.parametrize("columns", [80, 200])
def test_the_banner_wraps_at_the_terminals_width(columns):
    """The demo notice and the load line: between words, within the width (200: the control,
    where the notice is one line of more than 80 columns)."""
    child = spawn([*CLI[1:], "run", "--threads", "1", "--no-panel"], child_env(TERM="xterm"),
                  columns=columns)
    try:
        child.expect_exact(">>> ")
        banner = ANSI.sub("", child.before)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    # each line as the screen shows it (its last carriage-return segment), the bar left out
    shown = [ln.split("\r")[-1] if ln.split("\r")[-1] else ln.split("\r")[0]
             for ln in banner.split("\r\n")]
    lines = [ln for ln in shown if ln.strip() and "━" not in ln]
    assert lines[0].startswith("demo model:") and any("loaded in" in ln for ln in lines)
    widest = max(len(ln) for ln in lines)
    assert widest <= 80 if columns == 80 else widest > 80, lines


# ===== help =====


@pytest.mark.parametrize("command", ["", "run", "serve", "synth", "info", "verify", "audit",
                                     "bench"])
def test_help_fits_80_columns(command):
    p = run([*CLI, *([command] if command else []), "--help"], child_env(COLUMNS="80"))
    assert p.returncode == 0 and p.stderr == "", p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) > 5 and max(len(ln) for ln in lines) <= 80
    # a word wider than its column is cut with an ellipsis (was: FREETOKEN_MOE_PREFETCH_B…)
    assert not [ln for ln in lines if "\u2026" in ln]
    if command in ("run", "audit"):
        assert "FREETOKEN_MOE_PREFETCH_BUDGET" in p.stdout


# ===== thinking =====


def test_split_reasoning():
    assert split_reasoning("plan it\n</think>\n\nthe answer") == ("plan it", "the answer")
    assert split_reasoning("<think>\nplan\n</think>\n\nx") == ("plan", "x")
    assert split_reasoning("</think>\n\n</think>\n\ncode") == ("", "code")  # the demo's habit
    assert split_reasoning("no block at all") == ("", "no block at all")
    assert split_reasoning("a</think>b</think>c") == ("a", "b</think>c")  # only leading repeats


def test_think_switch(tiny_bf16, tmp_path, capsys, monkeypatch):
    counts = {}
    for flag in ("--think", "--no-think"):
        code, out, err = _main(["run", tiny_bf16, "-p", "hi", "-n", "2", "--json", flag], capsys,
                               monkeypatch)
        assert code == 0, err
        counts[flag] = json.loads(out)["prompt_tokens"]
    # the template closes an empty think block in the prompt: "<think>\n" becomes
    # "<think>\n\n</think>\n\n"
    assert counts["--no-think"] > counts["--think"]
    model = copy_model(tiny_bf16, tmp_path / "ck")
    cfg_file = model / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                            "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    cfg_file.write_text(json.dumps(cfg))
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2", "--no-think"], capsys,
                           monkeypatch)
    clean_error(code, err, "--no-think", "no thinking switch")
    code, out, err = _main(["run", model, "-p", "hi", "-n", "2"], capsys, monkeypatch)
    assert code == 0, err  # control: the same template without the flag


# ===== install =====


def _third_party_imports() -> dict[str, str]:
    """Top-level package -> a module of ftchat importing it, for every import outside the
    standard library and ftchat, except inside a `try` that handles ImportError."""
    import ast

    found: dict[str, str] = {}
    for path in sorted((ROOT / "ftchat").rglob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(
                    isinstance(h.type, ast.Name) and h.type.id in ("ImportError",
                                                                   "ModuleNotFoundError")
                    for h in node.handlers):
                guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in guarded:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "ftchat" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("-", "_")
                for d in deps}
    imported = _third_party_imports()
    assert "numpy" in imported and "torch" in imported  # the scan sees real imports
    missing = {pkg: where for pkg, where in imported.items() if pkg.lower() not in declared}
    assert missing == {}, missing


def test_every_module_imports():
    import importlib
    import pkgutil

    import ftchat

    names = [m.name for m in pkgutil.walk_packages(ftchat.__path__, "ftchat.")]
    assert len(names) > 50
    for name in names:
        importlib.import_module(name)


def test_verify_tokens_beyond_the_models_positions(tiny_bf16, capsys, monkeypatch):
    code, out, err = _main(["verify", tiny_bf16, "--prompts", "1", "-n", "100000"], capsys,
                           monkeypatch)
    # before: ran for hours; the flag must change: a usage error
    clean_error(code, err, "--max-new-tokens 100000", "4096 positions", status=2)


def _memory_cap(gib: int):
    """A child's address space capped at `gib` GiB: a runaway allocation is a MemoryError in it,
    not the machine's OOM killer."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))
    return cap


def test_verify_prompts_beyond_memory(tiny_bf16):
    # before: every prompt made and encoded up front: a MemoryError (internal error) here, the
    # OOM killer without the cap
    p = run([*CLI, "verify", str(tiny_bf16), "--prompts", "99999999999", "-n", "2"], child_env(),
            preexec_fn=_memory_cap(8))
    clean_error(p.returncode, p.stderr, "--prompts 99999999999", "at most 100,000", status=2)
    p = run([*CLI, "verify", str(tiny_bf16), "--prompts", "1", "-n", "2"], child_env(),
            preexec_fn=_memory_cap(8))
    assert p.returncode == 0, p.stderr  # control: the cap leaves room for a real run


def test_verify_ends_with_one_verdict_line(tiny_bf16, capsys, monkeypatch):
    code, out, err = _main(["verify", tiny_bf16, "--prompts", "1", "-n", "4"], capsys,
                           monkeypatch)
    assert code == 0, err
    assert out.splitlines()[-1].startswith("PASS: prefetch on matched off over 1 prompts")


def test_verify_that_fails_ends_with_a_fail_line(tiny_bf16, capsys, monkeypatch):
    from ftchat.debug.slot_audit import SlotAudit

    monkeypatch.setattr(SlotAudit, "audit", lambda self, view: None)  # the check never runs
    code, out, err = _main(["verify", tiny_bf16, "--prompts", "1", "-n", "4"], capsys,
                           monkeypatch)
    assert code == 1 and out.splitlines()[-1] == "FAIL: no slot audit ran", out


# ===== min-p =====


def test_min_p(tiny_bf16, capsys, monkeypatch):
    """min_p 1 keeps only the likeliest token: a sampled reply is then the greedy one, whatever
    the seed (control: min_p 0 at temperature 5 strays from it)."""
    def tokens(*flags):
        code, out, err = _main(["run", tiny_bf16, "-p", "hi", "-n", "8", "--json", *flags],
                               capsys, monkeypatch)
        assert code == 0, err
        return json.loads(out)["tokens"]

    greedy = tokens()
    assert tokens("--temp", "5", "--seed", "1", "--min-p", "1") == greedy
    assert tokens("--temp", "5", "--seed", "1", "--min-p", "0") != greedy
    code, out, err = _main(["run", tiny_bf16, "-p", "hi", "--min-p", "0.1"], capsys, monkeypatch)
    clean_error(code, err, "--min-p applies to sampling", status=2)
    code, out, err = _main(["run", tiny_bf16, "-p", "hi", "--temp", "1", "--min-p", "2"], capsys,
                           monkeypatch)
    clean_error(code, err, "--min-p 2.0", "0 to 1", status=2)
