"""The live status line of `ftchat serve`: the rate window and the cells on fixed figures
(expected text written out by hand), the figures read from a server's Metrics, and the real
server in a pseudo-terminal: drawn on a terminal, not with --quiet, not when stderr is a file."""

from __future__ import annotations

import io
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pexpect
import pytest
from rich.console import Console

from ftchat.server.metrics import Metrics
from ftchat.server.status import Rate, ServeFigures, StatusLine, status_rows
from ftchat.ui.panel import cells_text
from tests.server_util import ROOT, Server, free_port, wait_ready

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")
BUSY = ServeFigures(running=2, queued=1, decode_tps=812.44, prefill_tps=3120.0, served=5,
                    prefix_hits=3, cached_tokens=1204, misses_per_token=0.4167, offloaded=True)
IDLE = ServeFigures(running=0, queued=0, decode_tps=None, prefill_tps=None, served=0,
                    prefix_hits=0, cached_tokens=0, misses_per_token=None, offloaded=False)


def test_rate_over_the_window():
    r = Rate(window=2.0)
    assert r.update(0.0, 0) is None  # one sample: no rate yet
    assert r.update(1.0, 100) == 100.0  # 100 tokens in 1 s
    assert r.update(2.0, 300) == 150.0  # 300 in 2 s
    assert r.update(3.0, 300) == 100.0  # from t = 1 (100) to t = 3 (300): 200 in 2 s
    assert r.update(5.0, 300) is None  # nothing in the last 2 s: idle, not 0


def test_cells_of_a_busy_offloaded_server():
    assert cells_text(status_rows(BUSY), "", 80).plain == (
        "running 2   queued 1   decode tok/s 812.4   prompt tok/s 3120.0\n"
        "prefix hits 3/5   cached tokens 1,204   misses/token 0.42")
    assert cells_text(status_rows(BUSY), "", 140).plain == (
        "running 2   queued 1   decode tok/s 812.4   prompt tok/s 3120.0   prefix hits 3/5   "
        "cached tokens 1,204   misses/token 0.42")


def test_cells_of_an_idle_resident_server():
    # resident experts report no misses: no misses/token cell; idle rates are "-"
    assert cells_text(status_rows(IDLE), "", 100).plain == (
        "running 0   queued 0   decode tok/s -   prompt tok/s -   prefix hits 0/0   "
        "cached tokens 0")
    offloaded_unknown = ServeFigures(0, 0, None, None, 0, 0, 0, None, True)
    assert status_rows(offloaded_unknown)[-1] == ("misses/token", "-")


def test_a_note_below_the_cells_until_the_model_is_ready():
    state = ["loading"]
    line = StatusLine(Metrics(), Console(file=io.StringIO(), width=100), lambda: state[0])
    cells = "running 0   queued 0   decode tok/s -   prompt tok/s -   prefix hits 0/0   " \
        "cached tokens 0"
    assert line.render().plain == cells + "\nloading the model"
    state[0] = "failed"
    assert line.render().plain == cells + "\nthe model failed to load"
    state[0] = "ready"
    assert line.render().plain == cells


def test_figures_from_the_metrics():
    m = Metrics()
    m.set_backend({"misses_per_token": None, "slots": 40, "name": "offload"})
    line = StatusLine(m, Console(file=io.StringIO(), width=100))
    first = line.figures(10.0)
    assert first == ServeFigures(0, 0, None, None, 0, 0, 0, None, True)
    m.count_tokens(prefilled=64)
    m.count_tokens(decoded=2)
    m.count_tokens(decoded=2)
    m.record(64, 16, 3, 0.5, 48, 0.25, 2, {"misses_per_token": 1.5, "slots": 40}, "eos")
    m.record(20, 0, 1, 0.1, 20, 0.0, 0, {"misses_per_token": 1.25, "slots": 40}, "length")
    m.running, m.queue_depth = 1, 2
    assert line.figures(12.0) == ServeFigures(1, 2, 2.0, 32.0, 2, 1, 16, 1.25, True)
    assert "ftchat_prefix_cache_hits_total 1" in m.render().splitlines()


# ===== the real server on a pseudo-terminal =====

# runs ftchat serve with stderr sent to the file argv[1]; stdin and stdout stay the pty
STDERR_TO = ("import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644); "
             "os.dup2(fd, 2); os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")
LOGGED = r"ftchat serve: chatcmpl-\S+: prompt \d+ \(cached 0\), generated 3"


def _ask(server: Server) -> None:
    wait_ready(server)
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Who are you?"}], "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def serve_one_request(*flags: str, stderr_file=None) -> tuple[str, str | None]:
    """`ftchat serve` on the demo model in a 140-column pseudo-terminal, asked one request: what
    it wrote to the terminal until a second after the reply, without the escapes, and the
    stderr file then (before the server is stopped). The terminal is read all along (a full
    one would block the status line's writes)."""
    port = free_port()
    args = ["-m", "ftchat.cli", "serve", "--port", str(port), "--threads", "1",
            "--context", "256", *flags]
    if stderr_file is not None:
        args = ["-c", STDERR_TO, str(stderr_file), *args]
    child = pexpect.spawn(sys.executable, args, cwd=str(ROOT), encoding="utf-8",
                          dimensions=(24, 140),
                          env={"PYTHONPATH": str(ROOT), "TERM": "xterm", "OMP_NUM_THREADS": "1",
                               "PATH": "/usr/bin:/bin"})
    out: list[str] = []

    def read(wait: float) -> None:
        child.expect([pexpect.TIMEOUT, pexpect.EOF], timeout=wait)
        out.append(child.before)
        assert child.isalive(), "".join(out)

    try:
        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(_ask, Server(None, port, stderr_file))
            while not asked.done():
                read(0.2)
            asked.result()
        read(1.0)  # four refreshes of the status line
        logged = stderr_file.read_text() if stderr_file is not None else None
    finally:
        child.terminate(force=True)
    return ANSI.sub("", "".join(out)), logged


def test_the_status_line_on_a_terminal():
    out, _ = serve_one_request()
    # the request's log line printed above the status line, which counts the request
    assert re.search(LOGGED, out), out
    assert "running 0   queued 0" in out and "prefix hits 0/1" in out, out


def test_no_status_line_with_quiet():
    out, _ = serve_one_request("--quiet")
    assert "ftchat serve: http://127.0.0.1" in out  # what --quiet keeps
    assert "prefix hits" not in out and not re.search(LOGGED, out), out


def test_no_status_line_when_stderr_is_a_file(tmp_path):
    _, text = serve_one_request(stderr_file=tmp_path / "serve.log")
    assert re.search(LOGGED, text), text
    assert "prefix hits" not in text and "\x1b[" not in text


@pytest.mark.parametrize("flag", ["--quiet", "--no-panel"])
def test_serve_takes_the_status_flags(flag):
    from typer.testing import CliRunner

    from ftchat.cli import app

    res = CliRunner().invoke(app, ["serve", "--help"])
    assert res.exit_code == 0 and flag in ANSI.sub("", res.output)
