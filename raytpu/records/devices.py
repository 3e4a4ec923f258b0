"""What ran: the runtime, precision and devices of a run's workers, as rank 0 found them,
``<run dir>/devices.json``.

The plan settles the runtime and the precision on the driver; what only a worker's device can tell
(a GPU without bf16 runs the plan's bf16 as fp16 with a gradient scaler) is decided there, once,
and recorded here, so that the run's own files say what ran; the driver's summary prints it.
"""

from __future__ import annotations

import json
from typing import Any

from raytpu.storage.run_folder import RunFolder

RECORD = "devices.json"


def of(runtime: Any, planned_precision: str) -> dict[str, Any]:
    """A worker runtime's record (``runtime``: a ``raytpu.runtime.Runtime``)."""
    return {
        "runtime": runtime.name,
        "precision": runtime.precision,
        "planned_precision": planned_precision,
        "device": runtime.device_kind(),
        "devices_per_worker": runtime.local_devices,
        "workers": runtime.world_size,
    }


def record(folder: RunFolder, found: dict[str, Any]) -> None:
    folder.write_text(RECORD, json.dumps(found, indent=2))


def read(folder: RunFolder) -> dict[str, Any] | None:
    try:
        text = folder.read_text(RECORD)
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def line(found: dict[str, Any]) -> str:
    """``2 cuda worker(s) of 1 NVIDIA T4, fp16 (planned bf16: this device decided)``."""
    changed = found["precision"] != found["planned_precision"]
    why = f" (planned {found['planned_precision']}: the device has no {found['planned_precision']})" if changed else ""
    return (
        f"{found['workers']} {found['runtime']} worker(s) of {found['devices_per_worker']} {found['device']}, "
        f"{found['precision']}{why}"
    )
