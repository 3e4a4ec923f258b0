"""What ends a command early: a user's mistake, and a run that failed."""

from __future__ import annotations

from pathlib import Path


class ConfigError(ValueError):
    """A user error in a command, a config file or an override: the message says what to fix."""


class RunFailed(RuntimeError):
    """A run failed on a worker: the message is ``rank N: <its error>``; ``details`` its traceback."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


class WorkerFailed(RuntimeError):
    """A Ray worker's error as the driver shows it: the traceback formatted where it was raised
    (Ray Train hands the driver the bare exception; the traceback would stay in the worker's log)."""


def message_of(exc: BaseException) -> str:
    """An error's message on one line (a ``KeyError``'s without its quotes), else its type's name."""
    text = str(exc).strip()
    if isinstance(exc, KeyError):
        text = text.strip("'\"")
    return " ".join(text.split()) or type(exc).__name__


#: how a worker marks the one line its error is said in (the driver says it, once; no traceback)
FIXABLE_MARK = "raytpu-fixable: "
#: how a local worker marks a line of its output for its log only (a traceback: the console says one line)
LOG_ONLY_MARK = "raytpu-log: "


def error_line(error: BaseException) -> str:
    """An error as one readable line: its type and the first line of its message that says
    something (a library's message may open with a blank line, or end with a hint)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def fixable_line(error: BaseException) -> str | None:
    """The one line that says an error its user fixes (a checkpoint that cannot be written: a full
    disk, permissions; or such a line a worker relayed, marked), or None for an error whose
    traceback helps."""
    if type(error).__name__ == "CheckpointWriteError":
        return str(error)
    text = str(error)
    return text.removeprefix(FIXABLE_MARK) if text.startswith(FIXABLE_MARK) else None


def install_hint(extra: str) -> str:
    """The command that adds an extra to this install. raytpu is installed from its clone (it is
    not on PyPI): the clone's folder where raytpu runs from one, else the clone the user has."""
    root = Path(__file__).resolve().parents[1]
    source = str(root) if (root / "pyproject.toml").is_file() else "<your raytpu clone>"
    return f"pip install -e '{source}[{extra}]'"
