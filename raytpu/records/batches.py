"""The batch ``loop.auto_find_batch_size`` settled on, ``<run dir>/auto_batch_size.json``, and the
restarts a run allows for it.

The worker that runs out of memory records the smaller batch (``raytpu.worker.batch_finder``);
every rank of the restarted group, and a resumed run, reads it; the driver counts the restarts a
search may need (one per halving of the per-worker batch) and says in its summary what was found.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from raytpu.config import Config
from raytpu.config.batching import BatchPlan
from raytpu.storage.run_folder import RunFolder

RECORD = "auto_batch_size.json"  # in the run folder: the batch the finder settled on


#: ``raytpu train --local``: a worker that exits with this status asks for a restart (EX_TEMPFAIL)
EXIT_BATCH_REDUCED = 75


def max_reductions(per_worker_batch: int) -> int:
    """Step-downs a batch allows before one sample: each at least halves it (floor of log2)."""
    return max(per_worker_batch, 1).bit_length() - 1


def group_restarts(cfg: Config) -> int:
    """Restarts a multi-worker run may need for its batch reductions (0 without the finder)."""
    if not cfg.loop.auto_find_batch_size or cfg.scaling.num_workers == 1:
        return 0
    return max_reductions(BatchPlan.of(cfg).per_worker)


def ray_max_failures(cfg: Config) -> int:
    """``FailureConfig.max_failures`` for a Ray run: ``checkpoint.max_failures`` plus one restart per
    possible batch reduction, so that the finder works with the default 0 and leaves the user's
    budget for real failures (Ray counts both alike; a real failure may use a spare reduction)."""
    if cfg.checkpoint.max_failures == -1:
        return -1
    return cfg.checkpoint.max_failures + group_restarts(cfg)


def record(run_dir: RunFolder, plan: BatchPlan, devices: int, failed_at: int) -> None:
    """Write the chosen batch into the run folder (in one piece: every rank may write the same)."""
    found = {
        "global_batch_size": plan.global_batch,
        "replicas": plan.workers * devices,
        "grad_accum": plan.grad_accum,
        "per_device": plan.per_device(devices),
        "out_of_memory_at": failed_at,
    }
    run_dir.write_text(RECORD, json.dumps(found, indent=2))


def load_record(run_dir: RunFolder) -> dict[str, Any] | None:
    """The run folder's record as written by :func:`record`; None when there is none (or it is unreadable)."""
    try:
        text = run_dir.read_text(RECORD)
        return json.loads(text) if text is not None else None
    except (OSError, ValueError):
        return None


def read_record(run_dir: RunFolder, configured: BatchPlan, devices: int) -> tuple[BatchPlan, int] | None:
    """The recorded plan and the batch that ran out of memory, when the record is of this global
    batch over as many replicas and smaller than ``configured``; else None (a changed config
    searches afresh)."""
    found = load_record(run_dir)
    if found is None:
        return None
    same = (found.get("global_batch_size"), found.get("replicas")) == (
        configured.global_batch,
        configured.workers * devices,
    )
    grad_accum = found.get("grad_accum", 0)
    if not same or grad_accum <= configured.grad_accum or grad_accum % configured.grad_accum:
        return None
    return replace(configured, grad_accum=grad_accum), int(found.get("out_of_memory_at", 0))


def recorded_text(run_dir: RunFolder, global_batch: int) -> str | None:
    """The recorded batch in words (for the run's summary), when the finder stepped down."""
    found = load_record(run_dir)
    if found is None or found.get("global_batch_size") != global_batch:
        return None
    return BatchPlan(global_batch, found["replicas"], found["grad_accum"]).describe()
