"""Where a worker's reports and checkpoints go: one interface, whatever started the worker.

:class:`RayReporter` sends them through Ray Train (``ray.train.report`` copies each checkpoint
into the run's storage; this is the one module that calls it, and ``ray.train.get_checkpoint``);
:class:`FolderReporter` writes them into the run folder itself, laid out as Ray lays them out
(``<run dir>/checkpoint_<step>``), for local processes (``raytpu train --local``) and in-process
runs. Both keep checkpoints by one rule, Ray Train's own (``raytpu.records.reports``). Both ask
the driver's stop request the same way (:meth:`Reporter.interruption`).
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raytpu.records import checkpoints as ckpt
from raytpu.records.checkpoints import CheckpointWriteError, save_json
from raytpu.records.reports import (
    CHECKPOINT_NAME,
    REPORT,
    Entry,
    best_of,
    checkpoint_dirs,
    complete,
    entry_of,
    read_report,
    retained,
)
from raytpu.records.stop import confirm_stop, stop_requested
from raytpu.storage.run_folder import RunFolder

# ------------------------------------------------------------------ the one rule


# ------------------------------------------------------------------ the interface
class Reporter:
    """Where one worker's reports go; ``stop`` names the driver's stop request (``raytpu.driver.signals``)."""

    def __init__(self, rank: int = 0, world: int = 1, stop: str = "") -> None:
        self.rank, self.world, self.stop = rank, world, stop

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, name: str, owned: bool = True) -> None:
        """Every rank reports the same steps; each passes its own part of the checkpoint (or None).
        ``owned``: the reporter removes the folder once stored; else it is the user's (a launched
        script's ``save_state`` folder), left as it is and, in a run folder on the same disk,
        hard-linked rather than copied."""
        raise NotImplementedError

    def latest_checkpoint(self) -> Path | None:
        raise NotImplementedError

    def resume_candidates(self) -> Iterator[Path]:
        """The run's checkpoints to resume from, newest first, each a local folder when it is
        reached (an older one is the fallback when a newer one turns out damaged)."""
        latest = self.latest_checkpoint()
        if latest:
            yield latest

    def location_of(self, directory: Path) -> str:
        """Where a checkpoint that :meth:`resume_candidates` gave lives, as its user names it."""
        return str(directory)

    def interruption(self) -> str | None:
        """Called by every rank at the same steps: ``"stop"`` (checkpoint and stop: the driver was
        asked to), ``"preempted"`` (checkpoint now: a node is about to go) or ``None``; the same
        answer on every rank (rank 0 reads the request, the others get its answer)."""
        stop = self.rank == 0 and bool(self.stop) and stop_requested(self.stop)
        if from_rank_zero(stop, self.world):
            if self.rank == 0:
                confirm_stop(self.stop)
            return "stop"
        return "preempted" if self.preempted() else None

    def preempted(self) -> bool:
        """Whether a node of the run is about to be taken away (the same answer on every rank)."""
        return False

    def room_to_grow(self, workers: int) -> bool:
        """Whether ``workers`` more workers like this one fit on the cluster's free resources now
        (the same answer on every rank: rank 0 looks); never outside Ray."""
        return False

    def flush(self) -> None:
        """Wait until every checkpoint reported so far is stored where the run resumes from."""


def from_rank_zero(value: bool, world: int) -> bool:
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            shared = [value]
            dist.broadcast_object_list(shared, src=0)
            return bool(shared[0])
    return value


def link_checkpoint(source: Path, target: Path) -> Any:
    """``source``'s files hard-linked into ``target`` (copied where a link cannot be made: another
    disk); the checkpoint at ``target``."""
    import ray.train

    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        destination = target / path.relative_to(source)
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.unlink(missing_ok=True)
        try:
            os.link(path, destination)
        except OSError:
            shutil.copy2(path, destination)
    return ray.train.Checkpoint(str(target))


def persist_meta_last(storage: Any, checkpoint: Any, name: str) -> Any:
    """Ray Train's copy of a checkpoint into the run's storage, with ``meta.json`` (rank 0's) copied
    after every other file of it: Ray Train copies a folder's files in any order, side by side,
    and an object store has no rename, so the file written last is what says a copy is whole."""
    meta = Path(checkpoint.path) / ckpt.META
    held = meta.read_bytes() if meta.is_file() else None
    if held is not None:
        meta.unlink()
    stored = storage.persist_current_checkpoint(checkpoint, name)
    if held is not None:
        with stored.filesystem.open_output_stream(f"{stored.path}/{ckpt.META}") as out:
            out.write(held)
    return stored


# ------------------------------------------------------------------ Ray Train
class RayReporter(Reporter):
    """Reports and checkpoints through ``ray.train.report``; the run's latest checkpoint from Ray;
    preemption notices from Ray Train (``get_preemption_info``, agreed by its controller).

    A checkpoint is written to a local folder, then Ray Train copies it into the run's storage (a
    disk or a bucket) in the background (``CheckpointUploadMode.ASYNC``) and deletes the local
    copy; training goes on meanwhile. At most one copy is in flight: a checkpoint that comes while
    the previous one is still on its way waits for it. The end of the run waits for the last one."""

    def __init__(self, run_dir: str, rank: int = 0, world: int = 1, stop: str = "") -> None:
        super().__init__(rank, world, stop)
        self.folder = RunFolder(run_dir)
        self._restore: Any = None
        self._locations: dict[Path, str] = {}  # local copies of a bucket's checkpoints -> their URIs
        self._stored = threading.Event()
        self._stored.set()

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, name: str, owned: bool = True) -> None:
        import ray.train
        from ray.train import CheckpointUploadMode

        self._stored.wait()
        checkpoint = ray.train.Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None
        if checkpoint is not None:
            self._stored.clear()
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_dir_name=name or None,
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
            delete_local_checkpoint_after_upload=owned,
            checkpoint_upload_fn=functools.partial(self._store, linked=not owned and not self.folder.remote),
        )

    def _store(self, checkpoint: Any, name: str, linked: bool = False) -> Any:
        """The checkpoint into the run's storage (in Ray Train's upload thread), then the next may go:
        Ray Train's own copy, or hard links into a run folder on the same disk."""
        import ray.train

        storage = ray.train.get_context().get_storage()
        try:
            if linked:
                return link_checkpoint(Path(checkpoint.path), Path(storage.build_checkpoint_path_from_name(name)))
            return persist_meta_last(storage, checkpoint, name)
        except Exception as exc:  # a full disk, a refused or unreachable bucket
            failure = CheckpointWriteError.of(exc, self.folder.uri(name))
            if failure is None:
                raise
            raise failure from exc
        finally:
            self._stored.set()

    def latest_checkpoint(self) -> Path | None:
        import ray.train

        found = ray.train.get_checkpoint()
        if found is None:
            return None
        self._restore = found.as_directory()
        local = Path(self._restore.__enter__())
        self._locations[local] = self.folder.uri(Path(found.path).name)
        return local

    def resume_candidates(self) -> Iterator[Path]:
        """Ray's latest checkpoint, then the run folder's older ones (copied from a bucket when
        reached); the local copies of a bucket's checkpoints are removed once the caller is done."""
        copies: list[Path] = []
        try:
            latest = self.latest_checkpoint()
            if latest is not None:
                yield latest
            names = sorted((n for n in self.folder.children() if CHECKPOINT_NAME.match(n)), reverse=True)
            for name in names:
                if latest is None or name != Path(self._locations.get(latest, "")).name:
                    copies.append(self.folder.fetch(name))
                    self._locations[copies[-1]] = self.folder.uri(name)
                    yield copies[-1]
        finally:
            if self._restore is not None:
                self._restore.__exit__(None, None, None)  # Ray's own copy of its latest checkpoint
                self._restore = None
            for copy in copies:
                if self.folder.remote:
                    shutil.rmtree(copy.parent, ignore_errors=True)

    def location_of(self, directory: Path) -> str:
        return self._locations.get(directory, str(directory))

    def preempted(self) -> bool:
        import ray.train

        return ray.train.get_preemption_info() is not None

    def room_to_grow(self, workers: int) -> bool:
        room = self.rank == 0 and free_for(workers)
        return from_rank_zero(room, self.world)

    def flush(self, timeout_s: float = 600.0) -> None:
        """The last checkpoint stored, and its report taken by Ray Train's controller (which then
        names it the run's latest: a group restarted now resumes from it)."""
        import time

        from ray.train.v2._internal.execution.context import get_train_context

        self._stored.wait(timeout_s)
        results = get_train_context().execution_context.result_queue
        deadline = time.monotonic() + timeout_s
        while results.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)


def free_for(workers: int) -> bool:
    """Whether ``workers`` bundles of this worker's resources fit on the free resources of the
    cluster's nodes (read on the worker: Ray's per-node availability, this worker's own share)."""
    import ray
    from ray._private.state import available_resources_per_node

    from raytpu.runtime.placement import CHECKED, pack

    mine = ray.get_runtime_context().get_assigned_resources()
    bundle = {name: float(amount) for name, amount in mine.items() if name in CHECKED and amount}
    nodes = [{name: float(node.get(name, 0.0)) for name in CHECKED} for node in available_resources_per_node().values()]
    return bool(bundle) and pack([bundle] * workers, nodes)


# ------------------------------------------------------------------ a run folder
class FolderReporter(Reporter):
    """Checkpoints in the run folder itself, as Ray lays them out, shared by every local process:
    each rank adds its files to one staging folder, rank 0 publishes it once all are in, then
    prunes by :func:`retained`. ``reports``: every report this process made (tests read it)."""

    def __init__(
        self, run_dir: Path, num_to_keep: int = 2, mode: str = "min", rank: int = 0, world: int = 1, stop: str = ""
    ) -> None:
        super().__init__(rank, world, stop)
        self.root, self.num_to_keep, self.mode = Path(run_dir), num_to_keep, mode
        self.reports: list[dict[str, Any]] = []

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, name: str, owned: bool = True) -> None:
        self.reports.append(dict(metrics))
        if checkpoint_dir is None:
            return
        staging = self.root / f".{name}.partial"
        try:
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            self._barrier()
            shutil.copytree(checkpoint_dir, staging, dirs_exist_ok=True)
            if owned:
                shutil.rmtree(checkpoint_dir, ignore_errors=True)
            self._barrier()
            if self.rank == 0:
                save_json(staging / REPORT, {**metrics, "report": metrics.get("report", len(self.entries()) + 1)})
                target = self.root / name
                shutil.rmtree(target, ignore_errors=True)
                staging.rename(target)
                self._prune()
        except Exception as exc:
            failure = CheckpointWriteError.of(exc, staging)
            if failure is None:
                raise
            raise failure from exc
        self._barrier()

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def complete(self) -> list[Path]:
        """The run folder's complete checkpoints, oldest first."""
        return complete(self.root)

    def entries(self) -> list[Entry]:
        return [entry_of(path.name, read_report(path), order) for order, path in enumerate(self.complete())]

    def _prune(self) -> None:
        kept = {entry.name for entry in retained(self.entries(), self.num_to_keep, self.mode)}
        for path in self.complete():
            if path.name not in kept:
                shutil.rmtree(path)

    def latest_checkpoint(self) -> Path | None:
        found = self.complete()
        return found[-1] if found else None

    def best_checkpoint(self) -> Path | None:
        best = best_of(self.entries(), self.mode)
        return self.root / best.name if best else None

    def resume_candidates(self) -> Iterator[Path]:
        yield from checkpoint_dirs(self.root)
