"""Start `ftchat serve` as a subprocess on a free port and talk plain HTTP to it."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    proc: subprocess.Popen | None  # None: a server this process runs
    port: int
    log: Path
    key: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict | None = None, key: bool = True, timeout: float = 120):
        """(status, headers, parsed JSON or text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        h = dict(headers or {})
        if key and self.key:
            h.setdefault("Authorization", f"Bearer {self.key}")
        if isinstance(body, dict) or isinstance(body, list):
            body = json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        try:
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            data = r.read().decode()
        finally:
            conn.close()
        try:
            parsed = json.loads(data)
        except json.JSONDecodeError:
            parsed = data
        return r.status, {k.lower(): v for k, v in r.getheaders()}, parsed

    def metric(self, name: str) -> float:
        _, _, text = self.request("GET", "/metrics")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def tree_pythonpath() -> str:
    """This tree first, then the caller's PYTHONPATH (packages carried to a machine that lacks
    them: the device's fastapi and uvicorn)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, *args: str, key: str | None = None, wait: bool = True) -> Server:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": tree_pythonpath()}
    env.pop("FTCHAT_API_KEY", None)
    if key is not None:
        env["FTCHAT_API_KEY"] = key
    log = tmp / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "ftchat.cli", "serve", "--port", str(port), "--threads", "1",
           *args]
    proc = subprocess.Popen(["nice", "-n", "10", *cmd], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    server = Server(proc, port, log, key)
    if wait:
        wait_ready(server)
    return server


def wait_ready(server: Server, timeout: float = 180) -> list[int]:
    """Poll /health until 200; the statuses seen on the way."""
    seen, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        if server.proc is not None and server.proc.poll() is not None:
            raise RuntimeError(f"ftchat serve exited: {server.log.read_text()}")
        try:
            status = server.request("GET", "/health", key=False, timeout=5)[0]
            seen.append(status)
            if status == 200:
                return seen
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"ftchat serve not ready: {server.log.read_text()}")


def run_json(lines: list[dict], *args: str) -> list[dict]:
    """`ftchat run --json` on the demo model, one JSON line per prompt (both run and serve take
    the demo's generation_config.json: its repetition penalty)."""
    p = subprocess.run([sys.executable, "-m", "ftchat.cli", "run", "--json", "--threads", "1",
                        *args], input="".join(json.dumps(x) + "\n" for x in lines),
                       capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "PYTHONPATH": tree_pythonpath()})
    assert p.returncode == 0, p.stderr
    return [json.loads(x) for x in p.stdout.splitlines()]
