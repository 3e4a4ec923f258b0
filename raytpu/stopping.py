"""Stopping a run cleanly on a signal to the driver (SIGTERM, SIGINT / Ctrl-C).

The driver's handler sets a flag in a small per-run Ray actor; at their next log step the
workers agree on it (``RayReporter.interruption``), checkpoint the current step (without an
eval, so never as the best) and return, and rank 0 confirms. The driver then reports the stop
and exits with 128 + the signal's number; the same command resumes the run. A second signal
acts at once, as it would without raytpu (Ctrl-C aborts the run without that checkpoint).
"""

from __future__ import annotations

import signal
import sys
import threading
import uuid
from types import FrameType, TracebackType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def announce(signum: int) -> None:
    print(
        f"\nraytpu: {signal.Signals(signum).name} received: the workers checkpoint the current step at their "
        "next log step and stop (send it again to abort without that checkpoint)",
        file=sys.stderr,
        flush=True,
    )


class StopFlag:
    """The Ray actor of one run: the driver requests a stop, rank 0 confirms it."""

    def __init__(self) -> None:
        self.requested = False
        self.stopped = False

    def request(self) -> None:
        self.requested = True

    def is_requested(self) -> bool:
        return self.requested

    def confirm(self) -> None:
        self.stopped = True

    def has_stopped(self) -> bool:
        return self.stopped


class StopOnSignal:
    """Context manager for the driver: the run's :class:`StopFlag` actor (``name`` goes in the
    workers' payload) and SIGINT / SIGTERM handlers that set it."""

    def __init__(self) -> None:
        self.name = f"raytpu-stop-{uuid.uuid4().hex[:12]}"
        self.signum: int | None = None
        self.actor: Any = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        import ray

        self.actor = ray.remote(num_cpus=0)(StopFlag).options(name=self.name).remote()
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        signal.signal(signum, self.previous[signum])  # a second signal acts at once
        announce(signum)
        self.actor.request.remote()

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def stopped_by(self) -> int | None:
        """The signal that stopped the run, once the workers confirmed that they stopped on it."""
        import ray

        if self.signum is None or not ray.get(self.actor.has_stopped.remote(), timeout=60):
            return None
        return self.signum
