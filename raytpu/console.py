"""This process's console: C++ notices that no logging setting controls (gloo's "[Gloo] Rank N is
connected to ..." on connecting) kept off it at default verbosity, on the driver's side and the
workers'."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

_saved_stdout: list[int] = []


def mute_stdout() -> None:
    """Send this process's fd 1 to /dev/null until :func:`unmute_stdout`. For C++ notices that no
    logging setting controls, such as gloo's "[Gloo] Rank N is connected to ..." on connecting."""
    sys.stdout.flush()
    _saved_stdout.append(os.dup(1))
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)


def unmute_stdout() -> None:
    if _saved_stdout:
        saved = _saved_stdout.pop()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def muted_stdout(enabled: bool = True) -> Iterator[None]:
    if enabled:
        mute_stdout()
    try:
        yield
    finally:
        if enabled:
            unmute_stdout()
