"""An elastic run on the controller's side: what Ray Train's controller does with a worker range
(``ScalingConfig(num_workers=(min, max))``), said, recorded and bounded.

Ray Train restarts the worker group at whatever size fits after a failure; raytpu grows it itself,
at a checkpoint (the workers raise ``raytpu.records.resizes.Regrow`` once the group has stored it
and the cluster has room for more), so a growth loses no work. :class:`ElasticWatch`, a controller callback (it runs
in Ray Train's controller actor), then:

* records each change of size, with its cause (``raytpu.records.resizes``): the run's console line,
  goodput's ``resizing`` time and ``summary.json`` read it;
* keeps the run's failure budget: a growth or a lost node is what an elastic run is for, and Ray
  retries them without limit; any other failure counts against ``checkpoint.max_failures`` (and the
  batch finder's restarts), and past it ends the run with that failure;
* bounds the wait below the smallest size: a run that cannot get its smallest size back within
  ``scaling.node_start_timeout_s`` stops, its last checkpoint kept.
"""

from __future__ import annotations

import re
import time
from typing import Any

from ray.train.v2._internal.exceptions import (
    WorkerGroupStartupFailedError,
    WorkerGroupStartupTimeoutError,
    WorkerHealthCheckFailedError,
    WorkerHealthCheckTimeoutError,
)
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.controller.state import (
    InitializingState,
    ReschedulingState,
    ResizingState,
    RestartingState,
    RunningState,
    SchedulingState,
)

from raytpu.errors import RunFailed
from raytpu.records import resizes
from raytpu.records.resizes import GROW
from raytpu.storage.run_folder import RunFolder

#: what Ray says of a worker whose process or node went away
DIED = re.compile(r"actor died|node has died|health check failed", re.IGNORECASE)


class ElasticRunFailed(RunFailed):
    """An elastic run ended by its controller: its failure budget spent, or too long below its size."""


def cause_of(error: Any) -> tuple[str, str]:
    """``(kind, words)`` of the failure that ended a worker group: ``grow`` (a ``Regrow``),
    ``lost`` (a worker's process or node died), ``starting`` (a group that could not start in
    time, as when Ray first tries the old size after a loss), else ``failed``."""
    failures = dict(getattr(error, "worker_failures", None) or {})
    texts = [str(failure) for failure in failures.values()]
    if any(GROW in text for text in texts):
        return "grow", "capacity added"
    from ray.exceptions import RayActorError

    gone = (RayActorError, WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError)
    died = [text for rank, text in zip(failures, texts) if isinstance(failures[rank], gone) or DIED.search(text)]
    if died:
        address = re.search(r"\bip[:=]\s*'?([\d.]+)", " ".join(died), re.IGNORECASE)
        return "lost", f"node {address.group(1)} lost" if address else "a node lost"
    controller = getattr(error, "controller_failure", None)
    if isinstance(controller, (WorkerGroupStartupTimeoutError, WorkerGroupStartupFailedError)):
        return "starting", "workers could not start"
    text = str(error).strip()
    return "failed", text.splitlines()[-1] if text else type(error).__name__


class ElasticWatch(ControllerCallback):
    """The controller callback of an elastic run (module docstring). ``accumulation``: the
    accumulation steps at each size; ``planned``: the size the driver's plan said;
    ``failures_allowed``: other failures the run may retry (-1: any number); ``wait_limit_s``: how
    long it may stay below ``smallest`` workers."""

    def __init__(
        self,
        run_dir: str,
        command: str,
        accumulation: dict[int, int],
        planned: int,
        global_batch: int,
        failures_allowed: int,
        wait_limit_s: float,
    ) -> None:
        self.run_dir, self.command, self.global_batch = run_dir, command, global_batch
        self.accumulation, self.smallest, self.planned = accumulation, min(accumulation), planned
        self.failures_allowed, self.wait_limit_s = failures_allowed, wait_limit_s
        self.size = 0  # the size of the group that runs (or ran last)
        self.scheduled = 0  # the size the controller is starting
        self.ended: tuple[float, str] | None = None  # when and why the last group ended
        self.failures = 0
        self.waiting_since: float | None = None
        self.requester = ""  # the run's name with Ray's autoscaling coordinator (Ray Train's own)

    def after_controller_start(self, train_run_context: Any) -> None:
        self.requester = f"train-{train_run_context.run_id}"

    def after_controller_state_update(self, previous: Any, current: Any) -> None:
        if isinstance(current, SchedulingState):
            self.scheduled = current.scaling_decision.num_workers
        elif isinstance(current, RunningState) and isinstance(previous, SchedulingState):
            self._started()
        elif isinstance(current, ResizingState) and current is not previous:
            self.ended = (time.time(), "the cluster's capacity changed")
        elif isinstance(current, (RestartingState, ReschedulingState)) and current is not previous:
            self._ended(current.training_failed_error)
        if isinstance(current, (InitializingState, RestartingState, ReschedulingState)):
            self._check_wait()

    def _started(self) -> None:
        """A group of ``scheduled`` workers runs: a change of size is recorded and said in one line,
        the first against the size the plan said (a node lost before any group ran a step)."""
        before = self.size or self.planned
        if self.scheduled != before:
            ended, reason = self.ended or (time.time(), "the cluster's capacity changed")
            change = resizes.add(RunFolder(self.run_dir), ended, before, self.scheduled, reason, self.command)
            steps = (self.accumulation.get(before, 0), self.accumulation.get(self.scheduled, 0))
            print(f"raytpu: {resizes.line(change, self.global_batch, steps)}", flush=True)
        self.size, self.ended, self.waiting_since = self.scheduled, None, None

    def _ended(self, error: Any) -> None:
        kind, reason = cause_of(error)
        if kind != "starting" or self.ended is None:  # a group that cannot start keeps the cause found before
            self.ended = (time.time(), reason)
        if kind in ("lost", "grow"):
            self._look_again()
        if kind == "failed":
            self.failures += 1
            if 0 <= self.failures_allowed < self.failures:
                text = str(error).strip()
                raise ElasticRunFailed(
                    f"{text}\n{reason} (failure {self.failures}; checkpoint.max_failures allows "
                    f"{self.failures_allowed} besides lost nodes and growths)"
                )

    def _look_again(self) -> None:
        """Have Ray's autoscaling coordinator, whose view of the cluster Ray Train sizes the group
        from, look at the nodes now: it looks every 20 s, and a stale view restarts the group at its
        old size (a lost node's workers wait out ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 60 s)
        or misses the capacity a growth was for. Best effort: Ray's own view takes over on failure."""
        import ray
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        if not ray.is_initialized():  # outside a Ray Train controller: nothing to ask
            return
        try:
            coordinator = get_or_create_autoscaling_coordinator()
            ray.get(coordinator.get_reserved_resources.remote(self.requester, recompute=True), timeout=30)
        except Exception:  # the coordinator busy or gone: Ray Train decides on its next look
            return

    def _check_wait(self) -> None:
        now = time.time()
        self.waiting_since = self.waiting_since or now
        if now - self.waiting_since > self.wait_limit_s:
            after = f" after {self.ended[1]}" if self.ended else ""
            raise ElasticRunFailed(
                f"fewer than {self.smallest} worker(s) fit for {self.wait_limit_s:g} s{after} "
                "(scaling.node_start_timeout_s): the run's last checkpoint is kept; run the same command again "
                "to resume once the cluster has room, or lower the range's smallest size"
            )
