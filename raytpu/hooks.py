"""The hooks of a running loop: a :class:`Callback` watches a run without reaching into the trainer,
as Lightning's callbacks and Transformers' ``TrainerCallback`` do. A config names its callbacks by
import path (``loop.callbacks: [mypkg.watch.Spikes]``), a job adds its own (the ``HasCallbacks``
capability of ``raytpu.job``); each is made on every worker, with no arguments (rank 0 is the one
whose ``trainer.runtime.is_main`` is true). A hook runs on the host between steps, never inside a
step's graph: what it reads (``values``, ``metrics``) is already on the host.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from raytpu.errors import ConfigError


class Callback:
    """Hooks into a running loop. Every method is optional; the trainer passes itself, whose public
    attributes (``progress``, ``model``, ``runtime``, ``cfg``, ``job``) a callback may read."""

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


def load_callbacks(names: Sequence[str]) -> list[Callback]:
    """A new instance of each class ``names`` names (``pkg.module.Class`` or ``pkg.module:Class``)."""
    return [callback_class(name)() for name in names]


def callback_class(name: str) -> type[Callback]:
    """The :class:`Callback` subclass ``name`` names, or a one-line error that says what is wrong."""
    module_name, _, class_name = name.replace(":", ".").rpartition(".")
    try:
        found: Any = getattr(importlib.import_module(module_name), class_name) if module_name else None
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"loop.callbacks: cannot import {name!r} ({exc}); name a class as pkg.module.Class") from None
    if not (isinstance(found, type) and issubclass(found, Callback)):
        raise ConfigError(f"loop.callbacks: {name!r} is not a subclass of raytpu.hooks.Callback")
    return found
