"""User-facing errors: the CLI prints them as one line and exits non-zero."""

from __future__ import annotations


class FtchatError(Exception):
    """Base of every error ftchat reports to the user without a traceback."""


class ModelError(FtchatError):
    """A model folder, config or checkpoint that ftchat cannot read."""


class UsageError(FtchatError):
    """A flag the user must change, found past the option parser: a value invalid on its own, a
    bad combination, or a value this model or machine cannot take. The CLI exits 2, as for the
    parser's own usage errors; a failure no flag names (a file, a prompt, the device) exits 1."""


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
