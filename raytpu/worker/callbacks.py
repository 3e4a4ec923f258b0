"""Hooks into a running loop, for tests, benchmarks and features that watch a run without
reaching into the trainer. Every method is optional; the trainer passes itself, whose public
attributes (``progress``, ``model``, ``runtime``, ``cfg``) a callback may read."""

from __future__ import annotations

from typing import Any


class Callback:
    def on_step_start(self, trainer: Any, step: int) -> None:
        """Before optimizer step ``step`` (counted from 1) is traced or run."""

    def on_step_end(self, trainer: Any, step: int) -> None:
        """After step ``step``'s graph ran (and its log closures), before any eval or checkpoint."""

    def on_log(self, trainer: Any, step: int, values: dict[str, float]) -> None:
        """Every ``loop.log_every`` steps: the values read back from the device (``loss``, ``grad_norm`` ...)."""

    def on_eval(self, trainer: Any, split: str, metrics: dict[str, float]) -> None:
        """After an evaluation of ``split``, with its metrics reduced over the workers."""

    def on_checkpoint(self, trainer: Any, report: dict[str, Any]) -> None:
        """After a checkpoint was written and reported, with what the report carried."""
