"""`ftchat serve` stopped by a signal (Ctrl-C, SIGTERM from a supervisor, SIGHUP from a closed
terminal): a graceful shutdown, one note line, exit 0 (as llama-server), never a traceback."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests.server_util import start_server, tree_pythonpath, wait_ready

STOP_WITHIN_S = 10


def check_clean_stop(returncode: int | None, stderr: str, signame: str) -> None:
    """Exit 0, no traceback, and the stop's note as the last line of stderr."""
    assert returncode == 0, (returncode, stderr)
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == f"ftchat serve: stopped by {signame}", stderr


def test_the_check_catches_a_traceback_and_an_exit_status():
    # negative control of check_clean_stop: what serve printed on SIGHUP before the fix
    ok = "ftchat serve: http://...\nftchat serve: stopped by SIGHUP\n"
    check_clean_stop(0, ok, "SIGHUP")
    traceback = ("ERROR:    Traceback (most recent call last):\n  File ...\n"
                 "ftchat.errors.Terminated: 1\nftchat serve: stopped by SIGHUP\n")
    with pytest.raises(AssertionError):
        check_clean_stop(0, traceback, "SIGHUP")
    with pytest.raises(AssertionError):
        check_clean_stop(143, "error: stopped by SIGTERM\n", "SIGTERM")
    with pytest.raises(AssertionError):
        check_clean_stop(0, ok, "SIGTERM")  # the note names the signal that came


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT],
                         ids=lambda s: s.name)
def test_a_stop_signal_shuts_serve_down_cleanly(sig, tiny_bf16, tmp_path):
    server = start_server(tmp_path, str(tiny_bf16), "--device", "cpu")  # waits for /health 200
    try:
        server.proc.send_signal(sig)
        code = server.proc.wait(STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ftchat serve still runs {STOP_WITHIN_S} s after {sig.name}")
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    check_clean_stop(code, server.log.read_text(), sig.name)


@pytest.mark.parametrize("blocked", [True, False], ids=["uvicorn-missing", "installed"])
def test_serve_names_a_missing_server_package(blocked, tmp_path):
    # a broken install (uvicorn absent) is one line naming the package, not "internal error";
    # the control, with uvicorn importable, gets past the import to the model's own error
    block = "sys.modules['uvicorn'] = None; " if blocked else ""
    code = f"import sys; {block}from ftchat.cli import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.run([sys.executable, "-c", code, "serve", str(tmp_path / "no-such-model"),
                        "--device", "cpu"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": tree_pythonpath()})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    missing = "error: ftchat serve needs the package 'uvicorn', which is not installed"
    assert lines[0].startswith(missing) == blocked, p.stderr
    assert "internal error" not in p.stderr


@pytest.mark.parametrize("flag, status, message", [
    (("--threads", "100000"), 2, "error: --threads 100000: "),  # a bad flag: usage, exit 2
    (("--context", "99999999"), 2, "error: --context 99999999: "),
    ((), 0, None),  # the control: the same model loads and serves
])
def test_a_model_that_cannot_load_ends_serve_with_its_error(flag, status, message, tiny_bf16,
                                                            tmp_path):
    # the load runs on the engine thread after the HTTP server is up; its failure must still
    # end the process with `run`'s one-line error and exit status, not a server stuck at 503
    server = start_server(tmp_path, str(tiny_bf16), "--device", "cpu", *flag, wait=False)
    try:
        if message is None:
            wait_ready(server)
            server.proc.send_signal(signal.SIGTERM)
        returncode = server.proc.wait(60)
    finally:
        server.stop()
    lines = server.log.read_text().strip().splitlines()
    assert returncode == status, lines
    if message is not None:
        assert lines[-1].startswith(message) and "Traceback" not in "\n".join(lines), lines


def test_a_checkpoint_that_cannot_be_read_ends_serve_with_exit_1(tiny_bf16, tmp_path):
    # a runtime failure of the load (a truncated shard), not a flag: exit 1, one line naming it
    broken = tmp_path / "broken"
    shutil.copytree(tiny_bf16, broken)
    shard = max(broken.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)
    server = start_server(tmp_path, str(broken), "--device", "cpu", wait=False)
    try:
        returncode = server.proc.wait(60)
    finally:
        server.stop()
    text = server.log.read_text()
    last = text.strip().splitlines()[-1]
    assert returncode == 1 and "Traceback" not in text, text
    assert last.startswith("error: ") and shard.name in last and "internal error" not in last, text
