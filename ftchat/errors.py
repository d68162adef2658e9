"""User-facing errors: the CLI prints them as one line and exits non-zero."""

from __future__ import annotations


class FtchatError(Exception):
    """Base of every error ftchat reports to the user without a traceback."""


class ModelError(FtchatError):
    """A model folder, config or checkpoint that ftchat cannot read."""


class SettingsError(FtchatError):
    """An invalid flag or environment variable value."""
