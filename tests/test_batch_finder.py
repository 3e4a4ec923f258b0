"""``loop.auto_find_batch_size`` (``--auto_find_batch_size``): XLA's out-of-memory errors translated
for Accelerate's finder, the halving arithmetic, the record in the run folder, in-process runs
with each kind of injected error, and 2 local processes where only rank 1 runs out of memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate.utils.memory import should_reduce_batch_size

from raytpu import cli
from raytpu.config import load_config, with_values
from raytpu.config.batching import BatchPlan
from raytpu.config.plan import Facts, make_plan
from raytpu.records import batches
from raytpu.records import checkpoints as ckpt
from raytpu.runtime import make_runtime
from raytpu.storage.run_folder import RunFolder
from raytpu.worker import batch_finder as bf
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter
from tests.conftest import tensorboard_hparams
from tests.toy_job import OUT_OF_MEMORY

XLA_RESERVE = "Resource exhausted: Attempting to reserve 3.95G at the bottom of memory. That was not possible."


# ------------------------------------------------------------------ translation
@pytest.mark.parametrize("kind", ["xla", "xla_compile"])
def test_xla_out_of_memory_is_translated_into_what_accelerate_recognises(kind):
    error_type, text = OUT_OF_MEMORY[kind]
    original = error_type(text)
    assert not should_reduce_batch_size(original)  # why the translation is needed
    translated = bf.as_out_of_memory(original)
    assert translated is not original and should_reduce_batch_size(translated)
    assert "RESOURCE_EXHAUSTED" in str(translated) and "\n" not in str(translated)


def test_an_older_runtime_reservation_failure_counts_too():
    assert should_reduce_batch_size(bf.as_out_of_memory(RuntimeError(XLA_RESERVE)))


@pytest.mark.parametrize(
    "error",
    [
        OUT_OF_MEMORY["cuda"][0](OUT_OF_MEMORY["cuda"][1]),  # recognised by Accelerate as it is
        RuntimeError("RESOURCE_EXHAUSTED: Received message larger than max (5000000 vs. 4194304)"),
        RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space vmem."),
        ValueError("Expected input batch_size (4) to match target batch_size (8)"),
        KeyError("x"),
    ],
)
def test_other_errors_pass_through_untouched(error):
    assert bf.as_out_of_memory(error) is error


# ------------------------------------------------------------------ arithmetic
def test_halving_keeps_the_global_batch_by_raising_accumulation():
    plan, seen = BatchPlan(32, 2, 1), []
    while plan is not None:
        seen.append((plan.per_device(1), plan.grad_accum))
        assert plan.per_device(1) * plan.workers * plan.grad_accum == 32
        plan = plan.smaller(1)
    assert seen == [(16, 1), (8, 2), (4, 4), (2, 8), (1, 16)]
    assert len(seen) - 1 == batches.max_reductions(16)
    assert BatchPlan(32, 1, 1).smaller(2) == BatchPlan(32, 1, 2)  # 16 per device on 2 devices -> 8


def test_an_odd_batch_steps_down_by_its_smallest_factor():
    assert BatchPlan(24, 2, 2).smaller(1) == BatchPlan(24, 2, 4)  # 6 per device -> 3
    assert BatchPlan(24, 2, 4).smaller(1) == BatchPlan(24, 2, 12)  # 3 -> 1
    assert BatchPlan(24, 2, 4).describe() == "3 per device x 4 accumulation steps (global batch 24)"


def config(*overrides: str):
    cfg, _ = load_config(None, ["job.name=tests.toy_job", *overrides])
    return cfg


def test_ray_restarts_for_reductions_come_on_top_of_the_users_failures():
    on = ["loop.auto_find_batch_size=true", "scaling.num_workers=2", "data.global_batch_size=32"]
    assert batches.ray_max_failures(config(*on)) == 4  # 16 per worker: 8, 4, 2, 1
    assert batches.ray_max_failures(config(*on, "checkpoint.max_failures=2")) == 6
    assert batches.ray_max_failures(config(*on, "checkpoint.max_failures=-1")) == -1
    assert batches.ray_max_failures(config("scaling.num_workers=2", "checkpoint.max_failures=2")) == 2
    assert batches.ray_max_failures(config("loop.auto_find_batch_size=true")) == 0  # one worker retries in-process


def test_the_failure_config_ray_gets(tmp_path):
    from raytpu.config.plan import Facts, make_plan
    from raytpu.driver.ray_trainer import build_trainer

    cfg = config("loop.auto_find_batch_size=true", "scaling.num_workers=2", "scaling.runtime=cpu")
    trainer = build_trainer(make_plan(with_values(cfg, {"run.storage_path": str(tmp_path)}), Facts(mode="train")))
    assert trainer.run_config.failure_config.max_failures == 2  # 4 per worker: 2, 1


def test_the_flag_and_the_yaml_section_turn_it_on(tmp_path):
    assert config("--auto_find_batch_size").loop.auto_find_batch_size
    assert not config().loop.auto_find_batch_size
    path = tmp_path / "c.yaml"
    path.write_text("job: {name: tests.toy_job}\ntraining_arguments: {auto_find_batch_size: true}\n")
    assert load_config(path)[0].loop.auto_find_batch_size


# ------------------------------------------------------------------ record
def test_the_record_is_read_back_only_for_the_same_batch_and_replicas(tmp_path):
    folder, configured = RunFolder(tmp_path), BatchPlan(32, 2, 1)
    assert batches.read_record(folder, configured, 1) is None
    batches.record(folder, BatchPlan(32, 2, 4), devices=1, failed_at=8)
    assert batches.read_record(folder, configured, 1) == (BatchPlan(32, 2, 4), 8)
    assert batches.read_record(folder, BatchPlan(64, 2, 1), 1) is None  # another global batch: search afresh
    assert batches.read_record(folder, BatchPlan(32, 4, 1), 1) is None  # other replicas
    assert batches.read_record(folder, configured, 2) is None  # other replicas: 2 workers x 2 devices
    assert batches.read_record(folder, BatchPlan(32, 2, 8), 1) is None  # not smaller than configured
    assert batches.recorded_text(folder, 32) == "4 per device x 4 accumulation steps (global batch 32)"


# ------------------------------------------------------------------ one worker, in-process
def fit(run_dir: Path, *overrides: str):
    base = ["data.global_batch_size=8", "loop.log_every=2", "logging.progress_bar=false"]
    cfg, job = load_config(None, ["job.name=tests.toy_job", "loop.auto_find_batch_size=true", *base, *overrides])
    runtime = make_runtime("cpu", "auto", 1, 0, 0)
    reporter = FolderReporter(run_dir)
    (run_dir / "config.yaml").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("saved by the driver\n")

    trained = []  # the config of each attempt: the finder makes a new one for each batch

    def attempt(cfg):
        trained.append(cfg)
        return Trainer(cfg, job, runtime, run_dir, run_dir, reporter).fit()

    plan = make_plan(cfg, Facts(mode="train", local=True))
    bf.fit_finding_batch(plan, runtime, RunFolder(run_dir), attempt)
    assert cfg.loop.grad_accum == 1 and plan.config.loop.grad_accum == 1  # the run's own never changes
    return trained[-1], reporter


@pytest.mark.parametrize("kind", ["xla", "xla_compile", "cuda"])
def test_one_worker_steps_down_in_process_to_a_batch_that_fits(tmp_path, capsys, kind):
    cfg, reporter = fit(tmp_path, "job.oom_above=2", f"job.oom_kind={kind}")
    assert (cfg.loop.grad_accum, cfg.data.global_batch_size) == (4, 8)
    out = capsys.readouterr().out
    assert "auto_find_batch_size: out of memory at 8 per device; now 4 per device x 2 accumulation steps" in out
    assert "out of memory at 4 per device; now 2 per device x 4 accumulation steps (global batch 8)" in out
    meta = ckpt.read_meta(reporter.latest_checkpoint())
    saved = meta["config"]
    assert (meta["step"], saved["loop"]["grad_accum"], saved["data"]["global_batch_size"]) == (8, 4, 8)
    assert (tmp_path / "config.yaml").read_text() == "saved by the driver\n"  # the record says what ran
    assert json.loads((tmp_path / batches.RECORD).read_text())["per_device"] == 2
    values, _ = tensorboard_hparams(tmp_path / "tensorboard")  # the attempt that trained, not the first
    assert (values["loop.grad_accum"], values["data.global_batch_size"]) == (4, 8)


def test_a_resumed_run_starts_at_the_recorded_batch(tmp_path, capsys):
    fit(tmp_path, "job.oom_above=2")
    capsys.readouterr()
    cfg, reporter = fit(tmp_path, "loop.epochs=2")  # no out-of-memory now: the record alone decides
    assert cfg.loop.grad_accum == 4
    assert "now 2 per device x 4 accumulation steps" in capsys.readouterr().out
    assert ckpt.read_meta(reporter.latest_checkpoint())["step"] == 16


def test_out_of_memory_at_one_sample_is_one_clear_error(tmp_path):
    with pytest.raises(bf.NoBatchFits, match="out of memory at 1 sample per device.*lower data.global_batch_size"):
        fit(tmp_path, "job.oom_above=0")


def test_other_errors_are_not_retried(tmp_path):
    with pytest.raises(RuntimeError, match="fault injected"):
        fit(tmp_path, "job.fail_at_step=1")
    assert not (tmp_path / batches.RECORD).exists()


# ------------------------------------------------------------------ two local workers
def test_two_local_workers_restart_together_when_only_rank_1_runs_out_of_memory(tmp_path, capfd):
    config = tmp_path / "toy.yaml"
    config.write_text(f"job: {{name: tests.toy_job, samples: 32}}\ndata: {{path: {tmp_path}}}\n")
    overrides = ["scaling.num_workers=2", "data.global_batch_size=8", "logging.progress_bar=false"]
    overrides += ["job.oom_above=2", "job.oom_rank=1", "--auto_find_batch_size", f"run.storage_path={tmp_path}"]
    assert cli.main(["train", "--local", str(config), *overrides, "run.name=run"]) == 0
    out = capfd.readouterr().out
    assert "auto_find_batch_size: out of memory at 4 per device; now 2 per device x 2 accumulation steps" in out
    assert "batch size:        2 per device x 2 accumulation steps (global batch 8), found by auto_find" in out
    run_dir = tmp_path / "run"
    latest = sorted(p for p in run_dir.iterdir() if p.name.startswith("checkpoint_"))[-1]
    meta = ckpt.read_meta(latest)
    # rank 1 trains 2 per device too: at 4 it would have run out of memory again and stepped down to 1
    assert json.loads((run_dir / batches.RECORD).read_text())["grad_accum"] == 2
    assert (meta["step"], meta["config"]["loop"]["grad_accum"]) == (4, 2)
    assert torch.isfinite(torch.tensor(meta["metrics"]["valid/mse"]))
    assert "restarting the worker group" in (run_dir / "logs" / "rank_1.log").read_text()


@pytest.mark.integration
def test_two_ray_workers_restart_with_the_recorded_batch_within_no_failure_budget(tmp_path, capfd, ray_session):
    """Ray Train's FailureConfig restarts the group (checkpoint.max_failures stays 0: the budget
    for reductions is added) and both workers build their trainers with the recorded batch."""
    config = tmp_path / "toy.yaml"
    config.write_text(f"job: {{name: tests.toy_job, samples: 32}}\ndata: {{path: {tmp_path}}}\n")
    overrides = ["scaling.num_workers=2", "data.global_batch_size=8", "logging.progress_bar=false"]
    overrides += ["job.oom_above=2", "job.oom_rank=1", "--auto_find_batch_size", f"run.storage_path={tmp_path}"]
    assert cli.main(["train", str(config), *overrides, "run.name=ray"]) == 0
    out = capfd.readouterr().out
    assert "out of memory at 4 per device; now 2 per device x 2 accumulation steps (global batch 8)" in out
    latest = sorted(p for p in (tmp_path / "ray").iterdir() if p.is_dir() and p.name.startswith("checkpoint_"))[-1]
    assert ckpt.read_meta(latest)["config"]["loop"]["grad_accum"] == 2
