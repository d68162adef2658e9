"""`ftchat serve`: resolve the model, start the engine thread (it loads the model while the
HTTP server already answers /health with 503), then run uvicorn until Ctrl-C, SIGTERM or
SIGHUP, or until loading fails (serve then ends with that error, as `run` would). On a
terminal a live status line (status.py) is drawn on stderr below the log lines."""

from __future__ import annotations

import dataclasses
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TextIO

import uvicorn
from rich.console import Console

from ftchat.errors import FtchatError, UsageError
from ftchat.generation_defaults import generation_defaults
from ftchat.model.tokenizer import Tokenizer
from ftchat.process_io import signal_name
from ftchat.resolve import demo_notice, resolve_model
from ftchat.sampling import Sampling
from ftchat.server.app import ServerConfig, create_app
from ftchat.server.metrics import Metrics
from ftchat.server.status import StatusLine
from ftchat.server.worker import EngineWorker
from ftchat.settings import MAX_BATCH, MAX_GIB, Settings
from ftchat.ui.panel import isatty


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    queue: int = 8  # requests that may wait while one decodes
    parallel: int = 2  # sequences decoding together
    cache_ram_gib: float = 2.0  # host memory for prefix checkpoints


# every signal that stops the server stops it gracefully, as Ctrl-C: open requests get
# timeout_graceful_shutdown, then the process exits 0 (llama-server's way); SIGHUP is a closed
# terminal or a supervisor's stop, not a reload
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


class _Server(uvicorn.Server):
    """uvicorn's server, stopped by any of STOP_SIGNALS; the first one is kept in `stopped_by`
    instead of raised again after the shutdown (uvicorn's default: a 128 + N exit status, and
    for SIGHUP, which it does not handle, a traceback out of its event loop)."""

    stopped_by: int | None = None

    def __init__(self, config: uvicorn.Config, load_failed: Callable[[], bool]):
        super().__init__(config)
        self.load_failed = load_failed  # True once the model failed to load: stop serving

    async def on_tick(self, counter: int) -> bool:
        return self.load_failed() or await super().on_tick(counter)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only (a test's server in a thread)
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        self.stopped_by = self.stopped_by or sig
        super().handle_exit(sig, frame)


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound as uvicorn binds it; a host or port that cannot be used is
    one error line (uvicorn's own is a log line and exit status 3)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise FtchatError(f"--host {host} --port {port}: cannot listen there "
                          f"({e.strerror or e})") from None
    return sock


def serve(model: str | None, settings: Settings, options: ServeOptions,
          env: Mapping[str, str], stderr: TextIO) -> int:
    if not 1 <= options.parallel <= MAX_BATCH:  # as run --batch-size: before the model loads
        raise UsageError(f"--parallel {options.parallel}: expected 1 to {MAX_BATCH:,}")
    if options.queue < 0:
        raise UsageError(f"--queue {options.queue}: expected 0 or more")
    if not 0 < options.port < 65536:
        raise UsageError(f"--port {options.port}: expected 1 to 65535")
    if not 0 <= options.cache_ram_gib <= MAX_GIB:  # NaN fails this too; past it, bytes overflow
        raise UsageError(f"--cache-ram {options.cache_ram_gib}: expected 0 to {MAX_GIB:,} GiB")
    key = options.api_key
    if key is not None and (not key or key != key.strip()):  # the header's token is stripped:
        # such a key would refuse every client
        raise UsageError(f"the API key (--api-key or FTCHAT_API_KEY) {key!r}: expected a key "
                         "without spaces or line breaks around it")
    resolved = resolve_model(model, env)
    tokenizer = Tokenizer.from_folder(resolved.path)  # cheap: a bad folder fails here
    # a request without sampling fields decodes as `ftchat run` does on this model
    defaults = Sampling(**generation_defaults(resolved.path))
    metrics = Metrics()
    # the status line: on a terminal (--panel / --no-panel decide), never with --quiet; it
    # reads the worker's state (made below) only once drawn
    shown = isatty(stderr) if settings.panel is None else settings.panel
    status = StatusLine(metrics, Console(file=stderr, highlight=False),
                        lambda: worker.state) if shown and not settings.quiet else None
    log = status.log if status else lambda line: print(line, file=stderr, flush=True)
    if resolved.demo and not settings.quiet:
        log(demo_notice(resolved.path))
    settings = dataclasses.replace(settings, batch_size=options.parallel)  # slots, VRAM plan
    worker = EngineWorker(resolved, settings, options.queue, options.parallel,
                          int(options.cache_ram_gib * 2**30), metrics, log,
                          log_requests=not settings.quiet)
    app = create_app(ServerConfig(resolved.name, options.api_key, sampling=defaults), worker,
                     tokenizer, metrics)
    sock = listen(options.host, options.port)  # a taken port fails before the model loads
    worker.start()
    log(f"ftchat serve: http://{options.host}:{options.port}/v1 (model loading; /health says "
        "when it is ready)")
    try:
        with status.live() if status else nullcontext():
            # after the status line starts: uvicorn's log handler writes above it
            config = uvicorn.Config(app, host=options.host, port=options.port,
                                    log_level="warning", timeout_graceful_shutdown=1)
            server = _Server(config, lambda: worker.state == "failed")
            server.run(sockets=[sock])
    finally:
        worker.stop()
        sock.close()
    if worker.load_error is not None:  # as llama-server: a model that cannot load ends serve,
        raise worker.load_error  # reported by the CLI as `run` reports the same failure
    if server.stopped_by is not None and not settings.quiet:
        try:
            print(f"ftchat serve: stopped by {signal_name(server.stopped_by)}", file=stderr,
                  flush=True)
        except (OSError, ValueError):  # stderr gone with the terminal (SIGHUP)
            pass
    return 0
