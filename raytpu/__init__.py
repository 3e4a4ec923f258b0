"""raytpu: Ray-orchestrated distributed training for PyTorch on TPU, GPU and CPU."""

from __future__ import annotations

import os
from typing import Any

__version__ = "0.1.0"

#: TorchTPU, where it is installed, loads its TPU backend on every ``import torch`` (seconds, log lines,
#: and nothing to load on a machine without TPU chips): raytpu's driver never touches a device, and a
#: torch_tpu worker loads it itself (``raytpu.runtime.torch_tpu``); set to 1 to keep the autoload
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


__all__ = ["train", "test", "tune", "export", "RunSummary", "TestResult", "SweepResult", "ConfigError", "report"]


def __getattr__(name: str) -> Any:
    """The Python API (``raytpu.api``), loaded on first use: ``import raytpu`` stays light on workers."""
    if name in __all__ and name != "report":
        from raytpu import api

        return getattr(api, name)
    raise AttributeError(f"module 'raytpu' has no attribute {name!r}")


def report(metrics: dict[str, Any]) -> None:
    """Send ``metrics`` (numbers) to Ray Train from a script run by ``raytpu launch``; outside
    ``raytpu launch`` it does nothing, so the script keeps running under ``python``, ``torchrun``
    or ``accelerate launch``."""
    from raytpu.worker.script import report as publish

    publish(metrics)
