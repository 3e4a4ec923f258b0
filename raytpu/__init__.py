"""raytpu: Ray-orchestrated distributed training for PyTorch on TPU, GPU and CPU."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def report(metrics: dict[str, Any]) -> None:
    """Send ``metrics`` (numbers) to Ray Train from a script run by ``raytpu launch``; outside
    ``raytpu launch`` it does nothing, so the script keeps running under ``python``, ``torchrun``
    or ``accelerate launch``."""
    from raytpu.worker.script import report as publish

    publish(metrics)
