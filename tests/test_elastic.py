"""Elastic runs, without a cluster: the range in config files and on the command line, the batch at
every size (the global batch kept, accumulation absorbing the change, a size that cannot hold it
refused), the data position exact in samples across a change of size, the controller's record of
each change and its failure budget, goodput's ``resizing`` time, a group that stops at a
checkpoint to grow, and the commands that refuse a range. The multi-node runs that lose and regain
a node are in ``tests/test_multinode.py``."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from raytpu import cli
from raytpu.config import ConfigError, load_config, with_values
from raytpu.config.batching import BatchPlan, elastic_plans
from raytpu.config.plan import Facts, make_plan, worker_range
from raytpu.records import goodput, resizes
from raytpu.records.resizes import Regrow
from raytpu.runtime import make_runtime
from raytpu.runtime.placement import ClusterOffer
from raytpu.storage.run_folder import RunFolder
from raytpu.worker.data import EpochSampler
from raytpu.worker.loop import Growth, Trainer
from raytpu.worker.reporting import FolderReporter
from tests.conftest import ROOT

TOY = ["job.name=tests.toy_job", "logging.progress_bar=false"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "elastic.yaml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------ the range
def test_a_range_in_a_file_on_the_command_line_and_as_a_list(tmp_path):
    path = write(tmp_path, "job: {name: tests.toy_job}\nscaling: {num_workers: 1:2}\n")
    cfg, _ = load_config(path)
    assert worker_range(cfg) == (1, 2) and cfg.scaling.num_workers == 2
    for words in (["scaling.num_workers=2:4"], ["num_workers=[2, 4]"], ["scaling.num_workers=[2,4]"]):
        cfg, _ = load_config(None, [*TOY, "data.global_batch_size=24", *words])
        assert worker_range(cfg) == (2, 4), words
    fixed, _ = load_config(path, ["scaling.num_workers=2"])  # a single number typed: one size again
    assert worker_range(fixed) is None and fixed.scaling.num_workers == 2
    list_file = write(tmp_path, "job: {name: tests.toy_job}\nscaling: {num_workers: [1, 2], min_workers: 1}\n")
    assert worker_range(load_config(list_file)[0]) == (1, 2)
    for words, message in (
        (["scaling.num_workers=2:1"], "scaling.num_workers=2:1: the smallest size must be at most the largest"),
        (["scaling.num_workers=1:x"], "a range is MIN:MAX in whole numbers"),
        (["scaling.num_workers=[1, 2, 3]"], "a range is two whole numbers [MIN, MAX]"),
        (["scaling.num_workers=0:2"], "scaling.num_workers=0:2: a run cannot go on with 0"),
        (["scaling.num_workers=[0, 2]"], "scaling.num_workers=0:2: a run cannot go on with 0"),
    ):
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_config(None, [*TOY, *words])


def test_every_size_holds_the_global_batch_with_accumulation_absorbing_the_change():
    cfg, _ = load_config(None, [*TOY, "data.global_batch_size=64", "job.samples=1024"])
    message = "does not split over 3 workers, a size of scaling.num_workers=1:4"
    with pytest.raises(ConfigError, match=message) as refused:
        elastic_plans(cfg, [1, 2, 3, 4])
    assert "use data.global_batch_size=72 (a multiple of 12)" in str(refused.value)
    cfg, _ = load_config(None, [*TOY, "data.global_batch_size=48", "scaling.num_workers=2:4", "loop.grad_accum=2"])
    plans = elastic_plans(cfg, [2, 3, 4])
    assert plans[4] == BatchPlan(48, 4, 2) and plans[4].per_worker == 6
    assert plans[3] == BatchPlan(48, 3, 4) and plans[3].per_worker == 4  # 16 each: 8 x 2 would not fit
    assert plans[2] == BatchPlan(48, 2, 4) and plans[2].per_worker == 6  # never more per worker than planned
    assert BatchPlan(24, 4).sized(3) == BatchPlan(24, 3, 2)  # 8 per worker would not fit: 4 x 2 steps
    with pytest.raises(ConfigError, match="does not split over 3 workers"):
        load_config(None, [*TOY, "data.global_batch_size=8", "scaling.num_workers=2:3"])


def test_the_plan_says_the_range_and_each_size_and_a_group_runs_its_own_size():
    cfg, _ = load_config(None, [*TOY, "data.global_batch_size=8", "scaling.num_workers=1:2", "runtime=cpu"])
    offer = ClusterOffer(nodes=({"CPU": 2.0},), available={"CPU": 2.0})
    plan = make_plan(cfg, Facts(mode="train", offer=offer))
    note = "elastic, 1 to 2 workers: 2 x 4 per worker; 1 x 4 per worker x 2 accumulation steps (global batch 8"
    assert any(line.startswith(note) for line in plan.notes), plan.notes
    one = plan.at_size(1)
    assert (one.config.scaling.num_workers, one.config.loop.grad_accum, one.batch.global_batch) == (1, 2, 8)
    assert plan.at_size(2) is plan


def test_doctor_says_what_each_size_means(capsys):
    assert cli.main(["doctor", str(ROOT / "jobs/mshnet/small.yaml"), "scaling.num_workers=1:2"]) in (0, 1)
    assert "workers    elastic, 1 to 2 workers: 2 x 4 per worker; 1 x 4 per worker x 2 accumulation" in (
        capsys.readouterr().out
    )


# ------------------------------------------------------------------ the data position
def test_every_sample_of_an_epoch_is_seen_once_over_a_change_from_two_workers_to_one():
    """Two workers take 3 steps of a 64-sample global batch (32 each), then the run resumes on one
    worker (its 32 per micro-step, 2 accumulation steps) from the same step, as the loop skips:
    every sample of the epoch once, none skipped, across the change."""
    samples, global_batch = 1000, 64
    dataset = TensorDataset(torch.arange(samples))
    two, one = BatchPlan(global_batch, 2), BatchPlan(global_batch, 2).sized(1)
    assert two.steps_per_epoch(samples) == one.steps_per_epoch(samples) == samples // global_batch
    seen: list[int] = []
    done = 3
    for rank in range(2):
        sampler = EpochSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=7, drop_last=True)
        sampler.set_epoch(4)
        seen += [index for _, index in list(sampler)[: done * two.grad_accum * two.per_worker]]
    sampler = EpochSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=7, drop_last=True)
    sampler.set_epoch(4)
    sampler.skip(done * one.grad_accum * one.per_worker)  # what Trainer._train skips on a resume
    rest = [index for _, index in sampler][: (one.steps_per_epoch(samples) - done) * global_batch]
    everything = seen + rest
    assert len(everything) == len(set(everything)) == one.steps_per_epoch(samples) * global_batch
    whole = EpochSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=7, drop_last=True)
    whole.set_epoch(4)
    assert set(everything) == {index for _, index in list(whole)[: len(everything)]}  # the epoch's own order


# ------------------------------------------------------------------ the controller's watch
class FakeError(Exception):
    def __init__(self, worker_failures):
        super().__init__("Training failed due to worker errors")
        self.worker_failures = worker_failures


def test_the_watch_records_each_change_keeps_the_failure_budget_and_bounds_the_wait(tmp_path, capsys):
    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.execution.controller.state import (
        RestartingState,
        RunningState,
        SchedulingState,
    )
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision

    from raytpu.cluster.elastic import ElasticRunFailed, ElasticWatch, cause_of

    watch = ElasticWatch(str(tmp_path), "cmd", {1: 2, 2: 1}, 2, 64, failures_allowed=1, wait_limit_s=0.5)

    def run(workers: int) -> None:
        scheduling = SchedulingState(ResizeDecision(num_workers=workers, resources_per_worker={"CPU": 1}))
        watch.after_controller_state_update(RestartingState(None), scheduling)
        watch.after_controller_state_update(scheduling, RunningState())

    run(2)
    died = ActorDiedError()
    lost = FakeError({0: RuntimeError("gloo: connection reset"), 1: died})
    assert cause_of(lost)[0] == "lost"
    watch.after_controller_state_update(RunningState(), RestartingState(lost))
    run(1)
    grow = FakeError({0: RuntimeError(str(Regrow(8, 1)))})
    assert cause_of(grow) == ("grow", "capacity added")
    watch.after_controller_state_update(RunningState(), RestartingState(grow))
    run(2)
    changes = resizes.read(RunFolder(tmp_path))
    assert [(c["from"], c["to"], c["reason"]) for c in changes] == [(2, 1, "a node lost"), (1, 2, "capacity added")]
    out = capsys.readouterr().out
    assert "raytpu: workers 2 -> 1 (a node lost): global batch 64 kept, accumulation 1 -> 2" in out
    assert "raytpu: workers 1 -> 2 (capacity added): global batch 64 kept, accumulation 2 -> 1" in out
    bug = FakeError({0: ValueError("a bug")})
    watch.after_controller_state_update(RunningState(), RestartingState(bug))  # the one failure allowed
    run(2)
    with pytest.raises(ElasticRunFailed, match="failure 2; checkpoint.max_failures allows 1"):
        watch.after_controller_state_update(RunningState(), RestartingState(bug))
    waiting = ElasticWatch(str(tmp_path), "cmd", {1: 2, 2: 1}, 2, 64, failures_allowed=-1, wait_limit_s=0.2)
    state = RestartingState(lost)
    waiting.after_controller_state_update(RunningState(), state)
    time.sleep(0.3)
    with pytest.raises(ElasticRunFailed, match="fewer than 1 worker.s. fit for 0.2 s after a node lost"):
        waiting.after_controller_state_update(state, state)


def test_a_node_lost_while_the_first_group_starts_is_a_change_said_and_recorded(tmp_path, capsys):
    """The plan said 2 workers; a node goes before they ran a step (as the group starts, or before it
    is scheduled), and the first group that runs has 1: a change of size like any other (its line,
    its record, goodput's resizing)."""
    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.execution.controller.state import RestartingState, RunningState, SchedulingState
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision

    from raytpu.cluster.elastic import ElasticWatch

    watch = ElasticWatch(str(tmp_path), "cmd", {1: 2, 2: 1}, 2, 64, failures_allowed=0, wait_limit_s=60)
    for workers in (2, 1):
        scheduling = SchedulingState(ResizeDecision(num_workers=workers, resources_per_worker={"CPU": 1}))
        watch.after_controller_state_update(RestartingState(None), scheduling)
        if workers == 2:  # its workers never ran
            lost = FakeError({0: RuntimeError("gloo: connection reset"), 1: ActorDiedError()})
            watch.after_controller_state_update(scheduling, RestartingState(lost))
    watch.after_controller_state_update(scheduling, RunningState())
    changes = resizes.read(RunFolder(tmp_path))
    assert [(c["from"], c["to"], c["reason"]) for c in changes] == [(2, 1, "a node lost")]
    assert "raytpu: workers 2 -> 1 (a node lost): global batch 64 kept, accumulation 1 -> 2" in capsys.readouterr().out


def test_goodput_counts_the_time_from_a_change_of_size_to_the_next_step_as_resizing():
    command = {
        "id": "c",
        "started": 0.0,
        "ended": 100.0,
        "attempts": [
            {"first_step": 10.0, "recorded": 40.0, "final": False, "seconds": {}, "workers": 2},
            {"first_step": 60.0, "recorded": 95.0, "final": True, "seconds": {}, "workers": 1},
        ],
    }
    split = goodput.command_breakdown(command, [45.0])
    assert split["lost"] == 5.0 and split["resizing"] == 15.0 and split["productive"] == 65.0
    assert goodput.command_breakdown(command)["lost"] == 20.0  # a restart at one size: all of it lost


# ------------------------------------------------------------------ growing at a checkpoint
class RoomyReporter(FolderReporter):
    """A run folder whose cluster has room for more workers."""

    def room_to_grow(self, workers: int) -> bool:
        return True


def test_a_group_below_its_largest_size_stops_to_grow_once_its_checkpoint_is_stored(tmp_path, capsys):
    cfg, job = load_config(None, [*TOY, "job.samples=64", "data.global_batch_size=8", "loop.epochs=2"])
    run_dir = tmp_path / "run"
    reporter = RoomyReporter(run_dir)
    trainer = Trainer(cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), run_dir, tmp_path, reporter,
                      growth=Growth(largest=2))  # fmt: skip
    with pytest.raises(Regrow, match="step 8 is checkpointed"):
        trainer.fit()
    assert [path.name for path in sorted(run_dir.glob("checkpoint_*"))] == ["checkpoint_00000008"]
    assert "room for more than 1 workers: step 8 is checkpointed" in capsys.readouterr().out
    full = Trainer(cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), tmp_path / "full", tmp_path, RoomyReporter(
        tmp_path / "full"), growth=Growth(largest=1))  # fmt: skip
    full.fit()  # at its largest size: no growth
    assert (tmp_path / "full" / "checkpoint_00000016").is_dir()


# ------------------------------------------------------------------ where a range does not apply
def test_commands_that_run_one_size_refuse_a_range_in_one_line(tmp_path, capsys):
    config = str(ROOT / "jobs/mshnet/small.yaml")
    cases = [
        (["train", config, "scaling.num_workers=1:2", "--local"], "--local runs a fixed number of processes"),
        (["tune", config, "scaling.num_workers=1:2", "--search", "optim.lr=loguniform(1e-3,1e-1)"],
         "raytpu tune runs each trial at one size"),
        (["train", config, "scaling.num_workers=1:2", "data.loader=ray"], "an elastic run (a range of workers) needs"),
        (["train", config, "scaling.num_workers=1:2", "loop.auto_find_batch_size=true"],
         "loop.auto_find_batch_size with a range of workers"),
    ]  # fmt: skip
    for argv, message in cases:
        assert cli.main([*argv, f"run.storage_path={tmp_path}"]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len([line for line in err.splitlines() if "raytpu: error:" in line]) == 1, err
    sections = tmp_path / "launch.yaml"
    sections.write_text("scaling: {num_workers: 1:2}\n")
    script = tmp_path / "script.py"
    script.write_text("print('hi')\n")
    assert cli.main(["launch", "--config", str(sections), str(script)]) == 2
    assert "raytpu launch runs a script that owns its world size" in capsys.readouterr().err


def test_with_values_keeps_a_range_when_the_plan_sets_its_size():
    cfg, _ = load_config(None, [*TOY, "data.global_batch_size=8", "scaling.num_workers=1:2"])
    assert worker_range(with_values(cfg, {"scaling.num_workers": 2})) == (1, 2)
    assert json.loads(json.dumps(cfg.scaling.min_workers)) == 1


def test_ray_s_timeouts_on_a_busy_machine_are_one_line_each(capsys):
    """Under load Ray Train's elastic policy times out reading its reserved resources, and its
    placement-group cleaner's thread can die of a timeout: each is one line, no traceback."""
    import threading

    from raytpu.cluster.connect import ELASTIC_POLICY, one_line_for, without_traceback

    record = logging.LogRecord(ELASTIC_POLICY, logging.WARNING, __file__, 1, "Failed to get resources", (), None)
    try:
        raise TimeoutError("Get timed out")
    except TimeoutError:
        record.exc_info = sys.exc_info()
    assert without_traceback(record) and record.exc_info is None
    others = []
    hook = one_line_for(others.append, "PlacementGroupCleanerMonitor")
    for name in ("PlacementGroupCleanerMonitor", "mine"):
        thread = threading.Thread(target=lambda: None, name=name)
        hook(threading.ExceptHookArgs((TimeoutError, TimeoutError("Get timed out"), None, thread)))
    assert capsys.readouterr().err == "PlacementGroupCleanerMonitor stopped: TimeoutError: Get timed out\n"
    assert [args.thread.name for args in others] == ["mine"]


def test_a_streamed_text_corpus_may_be_elastic_its_steps_the_same_blocks_at_every_size():
    """Ray Data tables are split anew at each size (refused above); a streamed corpus hands every
    step the same blocks at any size (``raytpu.corpus.order``, tested in test_corpus_ray.py), so an
    elastic range plans with it: the global batch kept by accumulation."""
    config = str(ROOT / "jobs/causal_lm/small.yaml")
    cfg, _ = load_config(config, ["scaling.num_workers=1:2", "data.loader=ray"])
    plans = elastic_plans(cfg, [1, 2])
    assert (plans[1].grad_accum, plans[2].grad_accum) == (2, 1) and plans[1].global_batch == 32
