"""User-facing errors: the CLI prints them as one line and exits non-zero."""

from __future__ import annotations


class FtchatError(Exception):
    """Base of every error ftchat reports to the user without a traceback."""


class ModelError(FtchatError):
    """A model folder, config or checkpoint that ftchat cannot read."""


class UsageError(FtchatError):
    """A bad flag value or a bad combination of flags, found past the option parser: the CLI
    exits 2, as for the parser's own usage errors (runtime failures exit 1)."""


class SettingsError(UsageError):
    """An invalid flag or environment variable value: a usage error (exit 2), as the option
    parser's own."""


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
