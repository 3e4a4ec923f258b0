"""Stopping a run cleanly on a signal to the driver (SIGTERM, SIGINT / Ctrl-C): one mechanism for
every way a run starts.

The driver's handler (:class:`StopOnSignal`) files a stop request where the run's workers look for
it: the run's small :class:`StopFlag` Ray actor when the workers are Ray Train's (started by the
signal: a run that is never signalled starts no process for it), a file in a temporary folder of
the machine when they are local processes (``raytpu train --local``). Either way the request
is named by one string in the plan (``actor:<name>`` or ``file:<path>``); at their next log step
the workers read it (``raytpu.records.stop``; rank 0 reads, every rank gets its answer),
checkpoint the current step (without an eval, so never as the best) and return, and rank 0
confirms. The driver then reports the stop and exits with 128 + the signal's number; the same
command resumes the run. A second signal acts at once, as it would without raytpu (Ctrl-C aborts
the run without that checkpoint).
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from raytpu.records.stop import StopFlag

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def announce(signum: int) -> None:
    print(
        f"\nraytpu: {signal.Signals(signum).name} received: the workers checkpoint the current step at their "
        "next log step and stop (send it again to abort without that checkpoint)",
        file=sys.stderr,
        flush=True,
    )


# --------------------------------------------------------------- the workers' side


# --------------------------------------------------------------- the driver's side
class StopOnSignal:
    """Context manager for the driver: SIGINT / SIGTERM handlers that file a stop request, and
    ``spec``, which names where (it goes into the plan). ``local``: the workers are processes of
    this machine (a file says ``requested``, then ``stopped``); else Ray's (a :class:`StopFlag` actor)."""

    def __init__(self, local: bool = False) -> None:
        self.name = f"raytpu-stop-{uuid.uuid4().hex[:12]}"
        # named now, for the plan; the folder is made when the handler is installed (__enter__)
        self.file = Path(tempfile.gettempdir()) / self.name / "stop" if local else None
        self.spec = f"file:{self.file}" if self.file else f"actor:{self.name}"
        self.signum: int | None = None
        self.actor: Any = None
        self.previous: dict[int, Any] = {}
        self.confirmed: bool | None = None  # read when a local run's stop file is cleaned up

    def __enter__(self) -> StopOnSignal:
        if self.file is not None:
            self.file.parent.mkdir(mode=0o700)
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        signal.signal(signum, self.previous[signum])  # a second signal acts at once
        announce(signum)
        if self.file is not None:
            self.file.write_text("requested\n")
        else:
            import ray

            self.actor = ray.remote(num_cpus=0)(StopFlag).options(name=self.name).remote()

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.file is not None:
            self.confirmed = self._confirmed()
            shutil.rmtree(self.file.parent, ignore_errors=True)

    def stopped_by(self) -> int | None:
        """The signal that stopped the run, once the workers confirmed that they stopped on it."""
        if self.signum is None:
            return None
        stopped = self.confirmed if self.confirmed is not None else self._confirmed()
        return self.signum if stopped else None

    def _confirmed(self) -> bool:
        if self.file is not None:
            return self.file.is_file() and self.file.read_text().strip() == "stopped"
        import ray

        return bool(ray.get(self.actor.has_stopped.remote(), timeout=60))
