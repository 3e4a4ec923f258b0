"""A Ray run's progress bar drawn by the driver, for a driver in a Jupyter kernel.

A worker's console reaches the driver line by line (Ray's log forwarding), so a bar redrawn on rank
0 becomes one line per refresh in a notebook cell. When the driver runs in a kernel it names a
:class:`ProgressBoard` actor in the plan (``Facts.progress_board``); rank 0 posts its step and
postfix there instead of drawing (:class:`BoardPoster`), and the driver draws them as a notebook
progress bar (:class:`DriverBar`, ``tqdm.auto``: a widget where ipywidgets is installed).
"""

from __future__ import annotations

import sys
import threading
from types import TracebackType
from typing import Any

#: seconds between two looks of the driver at the board
EVERY_S = 0.5


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (IPython's shell of an ``IPKernelApp``)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def board_name(command: str) -> str:
    return f"raytpu-progress-{command}"


class ProgressBoard:
    """The Ray actor that holds rank 0's latest progress: ``{"n", "total", "postfix"}``."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def post(self, state: dict[str, Any]) -> None:
        self.state = state

    def read(self) -> dict[str, Any] | None:
        return self.state


class BoardPoster:
    """Rank 0's side: posts its step at each log step, never waiting for the actor."""

    def __init__(self, board: Any, total: int) -> None:
        self.board, self.total, self.postfix = board, total, {}

    @classmethod
    def find(cls, name: str, total: int) -> BoardPoster | None:
        """The poster to the board ``name``, or None where the driver made none (a Tune trial's)."""
        import ray

        try:
            return cls(ray.get_actor(name), total)
        except ValueError:
            return None

    def post(self, step: int, postfix: dict[str, Any] | None = None) -> None:
        self.postfix = postfix if postfix is not None else self.postfix
        self.board.post.remote({"n": step, "total": self.total, "postfix": self.postfix})


class DriverBar:
    """The driver's side: the board made on entry, a thread drawing what it holds, all gone on exit."""

    def __init__(self, name: str) -> None:
        self.name, self.board, self.bar = name, None, None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._draw_until_done, name="raytpu-progress", daemon=True)

    def __enter__(self) -> DriverBar:
        if self.name:
            import ray

            self.board = ray.remote(num_cpus=0)(ProgressBoard).options(name=self.name).remote()
            self.thread.start()
        return self

    def _draw_until_done(self) -> None:
        while not self.done.wait(EVERY_S):
            self._draw()
        self._draw()

    def _draw(self) -> None:
        import ray

        try:
            state = ray.get(self.board.read.remote(), timeout=10)
        except Exception:  # the instance is going away with the run: the bar keeps what it showed
            return
        if not state:
            return
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state["total"], initial=state["n"], desc="train", unit="step")
        self.bar.n = state["n"]
        self.bar.set_postfix(state["postfix"], refresh=True)

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        if self.board is None:
            return
        self.done.set()
        self.thread.join(timeout=15)
        if self.bar is not None:
            self.bar.close()
        import ray

        ray.kill(self.board)
