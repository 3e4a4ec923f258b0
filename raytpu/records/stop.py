"""A stop request, as the workers read it: the string in the plan (``actor:<name>`` or
``file:<path>``) names where the driver files it (``raytpu.driver.signals``).

A Ray run's request is its :class:`StopFlag` actor (it exists once the driver asked for a stop; rank
0 confirms on it); local processes' is a file that says ``requested``, then ``stopped``.
"""

from __future__ import annotations

from pathlib import Path


class StopFlag:
    """The Ray actor of one signalled run: it exists once the driver requested a stop, and rank 0
    confirms the stop on it."""

    def __init__(self) -> None:
        self.stopped = False

    def confirm(self) -> None:
        self.stopped = True

    def has_stopped(self) -> bool:
        return self.stopped


def stop_requested(spec: str) -> bool:
    """Whether the driver asked the run named by ``spec`` to stop (read on rank 0)."""
    kind, _, where = spec.partition(":")
    if kind == "actor":
        import ray

        try:
            ray.get_actor(where)
        except ValueError:  # no such actor: no signal yet
            return False
        return True
    return kind == "file" and Path(where).is_file()


def confirm_stop(spec: str) -> None:
    """Rank 0 tells the driver that the workers checkpointed and stopped."""
    kind, _, where = spec.partition(":")
    if kind == "actor":
        import ray

        ray.get(ray.get_actor(where).confirm.remote(), timeout=60)
    elif kind == "file":
        Path(where).write_text("stopped\n")
