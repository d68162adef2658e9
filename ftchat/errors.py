"""User-facing errors: the CLI prints them as one line and exits non-zero."""

from __future__ import annotations

import re
import sys


class FtchatError(Exception):
    """Base of every error ftchat reports to the user without a traceback."""


class ModelError(FtchatError):
    """A model folder, config or checkpoint that ftchat cannot read."""


class UsageError(FtchatError):
    """A flag the user must change, found past the option parser: a value invalid on its own, a
    bad combination, or a value this model or machine cannot take. The CLI exits 2, as for the
    parser's own usage errors; a failure no flag names (a file, a prompt, the device) exits 1."""


def check_positive(*flags: tuple[str, int | None]) -> None:
    """A usage error naming the first (flag, value) below 1; None is a flag not given."""
    for flag, n in flags:
        if n is not None and n < 1:
            raise UsageError(f"{flag} {n}: expected a positive integer")


class SettingsError(UsageError):
    """An invalid flag or environment variable value of the Settings, or one this model or
    machine cannot take: a usage error (exit 2), as the option parser's own."""


class StdoutError(FtchatError):
    """Writing to stdout failed (a full disk, /dev/full, a device error); not a closed pipe,
    which stays BrokenPipeError (the reader went away: `| head`)."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: raised in the main thread so that every `finally` runs (temporary
    output removed, terminal modes restored) before the process exits with 128 + the signal.

    A BaseException, as KeyboardInterrupt: an `except Exception` cannot swallow it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def out_of_memory_message(e: BaseException) -> str | None:
    """One line for a device allocation that failed (torch.OutOfMemoryError), else None. torch
    is looked up, not imported: an error torch raised means torch is loaded."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(e, torch.OutOfMemoryError):
        return None
    text = str(e)
    need = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    free = re.search(r"total capacity of ([\d.]+ [KMGT]?i?B) of which ([\d.]+ [KMGT]?i?B) is "
                     r"free", text)
    facts = []
    if need:
        facts.append(f"{need[1]} more was needed")
    if free:
        facts.append(f"{free[2]} of {free[1]} was free")
    detail = f" ({', '.join(facts)})" if facts else ""
    return (f"out of GPU memory{detail}: try a shorter --context, fewer --slots or a lower "
            f"--vram-budget (bench: fewer arms)")
