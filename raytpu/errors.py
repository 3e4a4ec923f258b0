"""The two kinds of failure the command line reports: a user's mistake, and a run that failed."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in a command, a config file or an override: the message says what to fix."""


class RunFailed(RuntimeError):
    """A run failed on a worker: the message is ``rank N: <its error>``; ``details`` its traceback."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details
