"""MLflow and Weights & Biases as places a run is followed (``logging.report_to``), through their own
libraries, on rank 0, beside TensorBoard: the same scalars at the same steps, the resolved config as
the run's parameters, and the best checkpoint's location as a tag.

Each tracker sends from a thread of its own (:class:`Sender`), so a step never waits on a tracking
server; one that stops answering mid-run is said once, as a warning, and the run goes on with the
others (TensorBoard keeps everything). The tracker's run id is kept in the run folder
(``trackers.json``), so that a resumed run continues the same MLflow run and the same W&B run.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from raytpu.storage.run_folder import RunFolder

#: the run folder's record of its trackers' run ids
TRACKERS = "trackers.json"

#: the run folder's W&B files (``wandb.init(dir=...)`` makes this folder in the one it is given)
WANDB = "wandb"

#: how long a tracker's last messages may take to leave at the end of a run
DRAIN_S = 30.0


class Sender:
    """Calls made on a thread of their own, in order; the first that fails is said through ``warn``
    once, and the rest are dropped (the tracker is gone for this run)."""

    def __init__(self, name: str, warn: Callable[[str], None]) -> None:
        self.name, self.warn = name, warn
        self.failed = False
        self.calls = 0  # calls made so far (the first opens the tracker's run)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"raytpu-{name}", daemon=True)
        self._thread.start()

    def send(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if not self.failed:
            self._queue.put((call, args, kwargs))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._call(*item)
            finally:
                self._queue.task_done()

    def _call(self, call: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
        if not self.failed:
            try:
                call(*args, **kwargs)
            except Exception as exc:  # a server that went away: the run goes on without this tracker
                what = "stopped taking this run's metrics" if self.calls else "could not open this run's tracker run"
                self.failed = True
                reason = " ".join(str(exc).split())[:200] or type(exc).__name__
                self.warn(f"warning: {self.name} {what} ({reason}); the run goes on, its metrics are in TensorBoard")
            self.calls += 1

    def drain(self, timeout: float = DRAIN_S) -> None:
        """Wait until every call given so far has been made (or ``timeout`` passed)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self, timeout: float = DRAIN_S) -> None:
        self._queue.put(None)
        self._thread.join(timeout)


def quick_mlflow_requests() -> None:
    """MLflow's HTTP client retries a request for minutes by default: one retry and a 10 s timeout
    make a lost tracking server a warning within seconds (a value the user set wins)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


class MLflowTracker:
    """One MLflow run through ``MlflowClient`` (no global state): created in the experiment, or
    continued (``run_id``) when the run resumes; params once, metrics in batches, tags; terminated
    with the run's status at the end. A run of ``raytpu tune`` is the child of the sweep's run."""

    name = "MLflow"

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, run_id: str = "", parent: str = "") -> None:
        quick_mlflow_requests()
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri)
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id, self.new = run_id, False
            return
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        tags = {"mlflow.parentRunId": parent} if parent else {}
        self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        self.new = True

    def ids(self) -> dict[str, str]:
        return {"run_id": self.run_id}

    def params(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(key, str(value)[:6000]) for key, value in values.items()]
        for start in range(0, len(items), 100):  # MLflow takes 100 params a request
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def scalars(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def tags(self, values: dict[str, str]) -> None:
        for key, value in values.items():
            self.client.set_tag(self.run_id, key, value)

    def close(self, completed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if completed else "KILLED")


class WandbTracker:
    """One W&B run through ``wandb``: ``wandb.init`` with the run's own id, resumed when the run
    resumes; its files (an offline run's whole history with ``WANDB_MODE=offline``) in the run
    folder's ``wandb/``. A run of ``raytpu tune`` is in the sweep's group."""

    name = "W&B"

    def __init__(
        self, project: str, run_name: str, directory: str, mode: str, run_id: str = "", group: str = ""
    ) -> None:
        import wandb

        self.new = not run_id
        run_id = run_id or uuid.uuid4().hex[:12]  # W&B's ids: lower-case letters and digits
        self.run = wandb.init(
            project=project,
            name=run_name,
            id=run_id,
            resume="allow",
            dir=directory,
            mode=mode or None,
            group=group or None,
            settings=wandb.Settings(silent=True, console="off"),
        )

    def ids(self) -> dict[str, str]:
        return {"run_id": self.run.id}

    def params(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def tags(self, values: dict[str, str]) -> None:
        for key, value in values.items():
            self.run.summary[key] = value

    def close(self, completed: bool) -> None:
        self.run.finish(exit_code=0 if completed else 1)


class RunRecord:
    """``trackers.json``: each tracker's run id, and the command that made them (a retry of the same
    command continues them even before its first checkpoint). Written by each tracker's thread as
    its run opens, one at a time."""

    def __init__(self, folder: RunFolder, command: str) -> None:
        self.folder, self.command = folder, command
        self._lock = threading.Lock()

    def saved(self, resumed: bool) -> dict[str, Any]:
        """The recorded runs to continue: those of a run resumed from a checkpoint, or of an earlier
        attempt of this same command; else none (a new run starts new tracker runs)."""
        try:
            saved = json.loads(self.folder.read_text(TRACKERS) or "{}")
        except ValueError:
            return {}
        same_command = bool(self.command) and saved.get("command") == self.command
        return saved if resumed or same_command else {}

    def add(self, name: str, ids: dict[str, str]) -> None:
        with self._lock:
            try:
                saved = json.loads(self.folder.read_text(TRACKERS) or "{}")
            except ValueError:
                saved = {}
            if saved.get("command") != self.command:
                saved = {"command": self.command}
            saved[name] = ids
            self.folder.write_text(TRACKERS, json.dumps(saved, indent=2))


class Trackers:
    """The run's trackers on rank 0, each opened and fed from its own :class:`Sender`: a tracking
    server that does not answer when the run starts is a warning, never a failed attempt."""

    def __init__(
        self, openers: dict[str, Callable[[], Any]], warn: Callable[[str], None], record: RunRecord | None = None
    ) -> None:
        self.record = record
        self.opened: dict[str, Any] = {}
        self.senders: dict[str, Sender] = {}
        for name, opener in openers.items():
            self.senders[name] = Sender(TRACKER_NAMES[name], warn)
            self.senders[name].send(self._open, name, opener)

    def _open(self, name: str, opener: Callable[[], Any]) -> None:
        tracker = opener()
        self.opened[name] = tracker
        if self.record is not None:
            self.record.add(name, tracker.ids())

    def __bool__(self) -> bool:
        return bool(self.senders)

    def _each(self, method: str, *args: Any, new_only: bool = False) -> None:
        for name, sender in self.senders.items():
            sender.send(self._call, name, method, args, new_only)

    def _call(self, name: str, method: str, args: tuple, new_only: bool) -> None:
        tracker = self.opened[name]
        if tracker.new or not new_only:
            getattr(tracker, method)(*args)

    def params(self, values: dict[str, Any]) -> None:
        """The config as the run's parameters, once: a resumed tracker run has them already."""
        self._each("params", values, new_only=True)

    def scalars(self, values: dict[str, float], step: int) -> None:
        self._each("scalars", dict(values), step)

    def tags(self, values: dict[str, str]) -> None:
        self._each("tags", dict(values))

    def drain(self) -> None:
        """Every tracker has what it was given (at a checkpoint: what a run resumed from it does not
        log again is already sent)."""
        for sender in self.senders.values():
            sender.drain()

    def close(self, completed: bool) -> None:
        self._each("close", completed)
        for sender in self.senders.values():
            sender.close()


#: the trackers by their ``logging.report_to`` names, as the console names them
TRACKER_NAMES = {"mlflow": MLflowTracker.name, "wandb": WandbTracker.name}


def open_trackers(
    logging: Any, folder: RunFolder, run_name: str, resumed: bool, warn: Callable[[str], None], command: str = ""
) -> Trackers:
    """The trackers ``logging.report_to`` names besides TensorBoard, their runs continued where the
    run resumes, or where an earlier attempt of ``command`` made them (``trackers.json``), else new
    ones, whose ids are recorded there. Each opens on its own thread."""
    record = RunRecord(folder, command)
    saved = record.saved(resumed)
    experiment = logging.experiment or "raytpu"  # the driver's plan names it; a Trainer made in-process may not
    openers: dict[str, Callable[[], Any]] = {}
    if "mlflow" in logging.report_to:
        run_id = saved.get("mlflow", {}).get("run_id", "")
        uri = logging.mlflow_tracking_uri or None
        openers["mlflow"] = functools.partial(
            MLflowTracker, uri, experiment, run_name, run_id, logging.mlflow_parent_run
        )
    if "wandb" in logging.report_to:
        run_id = saved.get("wandb", {}).get("run_id", "")
        directory = str(folder.local())
        mode, group = logging.wandb_mode, logging.wandb_group
        openers["wandb"] = functools.partial(WandbTracker, experiment, run_name, directory, mode, run_id, group)
    return Trackers(openers, warn, record)
