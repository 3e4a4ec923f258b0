"""Where a run's time goes: the goodput breakdown's arithmetic, a run with known delays injected in
each phase (in-process here; on 2 Ray workers and across a failure and a resume in
tests/test_faults.py), and traces of a window of steps on the cpu runtime (on XLA: tests/test_xla.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from raytpu.config import ConfigError, load_config
from raytpu.records import goodput
from raytpu.runtime import make_runtime
from raytpu.storage.run_folder import RunFolder
from raytpu.worker import timing
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter
from tests import toy_job
from tests.conftest import run_python, traced_steps

#: 64 samples, 8 a step: 8 steps an epoch, 2 epochs, a checkpoint (and an eval) at each epoch end
BASE = ["job.name=tests.toy_job", "data.global_batch_size=8", "loop.epochs=2", "loop.log_every=4",
        "logging.progress_bar=false"]  # fmt: skip
#: the delays each category must show: 16 steps x 0.05 s of step; 16 x 8 samples x 4 ms of loading
#: (the valid split's 16 samples are loaded by evaluations); 2 checkpoints x 0.25 s of writing
DELAYS = ["job.step_sleep=0.05", "job.item_sleep=0.004", "job.checkpoint_sleep=0.25"]
INJECTED = {"productive": 16 * 0.05, "input": 16 * 8 * 0.004, "checkpointing": 2 * 0.25}


def breakdown_of(run_dir: Path) -> dict:
    return json.loads((run_dir / goodput.RECORD).read_text())


def test_commands_and_attempts_add_up_to_the_wall_time_with_restarts_lost():
    """Two commands: the first one's worker group restarts once (after its checkpoint at t=30 the
    group died; the new one trains from t=40) and it then fails (its last record at 70, its end at
    75: lost); the second resumes and completes (its end after its last record: shutdown)."""

    def attempt(first: float, recorded: float, final: bool, **seconds: float) -> dict:
        phases = {"input": 0.0, "evaluation": 0.0, "checkpointing": 0.0, "compilation": 0.0, **seconds}
        return {"id": str(first), "first_step": first, "recorded": recorded, "final": final, "seconds": phases}

    record = {
        "commands": [
            {"id": "a", "started": 0.0, "ended": 75.0, "outcome": "failed",
             "attempts": [attempt(10, 30, False, input=2, compilation=3), attempt(40, 70, False, checkpointing=1)]},
            {"id": "b", "started": 100.0, "ended": 130.0, "outcome": "completed",
             "attempts": [attempt(105, 125, True, evaluation=4)]},
        ]
    }  # fmt: skip
    result = goodput.breakdown(record)
    categories = result["categories"]
    assert categories == {"startup": 15.0, "compilation": 3.0, "productive": 15 + 29 + 16, "input": 2.0,
                          "evaluation": 4.0, "checkpointing": 1.0, "lost": 10 + 5, "resizing": 0.0,
                          "shutdown": 5.0}  # fmt: skip
    assert result["wall_s"] == 75 + 30 and result["goodput"] == pytest.approx(60 / 105)
    assert goodput.summary_line({**record, **result}).startswith("57.1% of 105.0 s (startup 15.0 s, compilation 3.0")
    # the resuming command alone, as its console line says it beside the run's: 16 of its 30 s productive
    second = goodput.command_summary(record, goodput.Command("b", 100.0))
    assert second.startswith("53.3% of 30.0 s (startup 5.0 s, compilation 0.0 s, input 0.0 s, evaluation 4.0 s")


def test_a_command_s_start_up_splits_at_its_first_attempt_s_marks():
    marks = {"process": 104.0, "clock": 106.5, "built": 109.0, "resumed": 109.5}
    attempt = {"first_step": 110.0, "recorded": 125.0, "final": True, "seconds": {}, "marks": marks}
    command = {"id": "c", "started": 100.0, "ended": 130.0, "outcome": "completed", "attempts": [attempt]}
    parts = goodput.startup_parts(command)
    assert parts == {"driver": 4.0, "worker set-up": 2.5, "build": 2.5, "resume": 0.5, "first step": 0.5}
    assert sum(parts.values()) == goodput.command_breakdown(command)["startup"]
    clock = timing.StepClock(None, goodput.Command("c", time.time()))
    clock.mark("built")
    clock.step_started()
    clock.mark("late")  # after the first step: not start-up
    assert set(clock.attempt(final=False)["marks"]) == {"process", "clock", "built"}


def test_a_process_s_start_is_its_age_before_the_wall_clock_s_now(monkeypatch):
    """A process that slept 1 s before asking started at least 1 s before it asked, and its start is
    its age before the wall clock's now (never the boot time plus its age, which the kernel rounds)."""
    done = run_python(["-c", "import time; time.sleep(1); from raytpu.records.goodput import process_started; "
                       "print(time.time() - process_started())"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert 1 < float(done.stdout) < 30  # the interpreter's start, the sleep and the import
    real, before = time.time, goodput.process_started()
    monkeypatch.setattr(goodput.time, "time", lambda: real() + 240.0)  # the wall clock set 4 minutes forward
    assert goodput.process_started() - before == pytest.approx(240.0, abs=1.0)


def test_an_attempt_recorded_inside_a_phase_counts_the_phase_up_to_then():
    """The loop records its attempt before a checkpoint becomes resumable (a worker killed right
    after it loses none of the attempt), while the checkpointing phase is still running."""
    clock = timing.StepClock(None, goodput.Command("c", time.time()))
    clock.step_started()
    clock.step_ended()
    with clock.phase("checkpointing"):
        time.sleep(0.05)
        inside = clock.attempt(final=False)["seconds"]["checkpointing"]
    after = clock.attempt(final=False)["seconds"]["checkpointing"]
    assert 0.05 <= inside <= after


class Clock:
    """A clock that moves only when the toy job sleeps: the loop's own time is then none, and each
    category holds exactly the delays injected into it, however busy the machine."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_in_process_delays_land_in_their_categories_and_add_up_to_the_wall_time(tmp_path, monkeypatch):
    clock = Clock()
    for module in (timing, goodput, toy_job):  # what the loop and the record read the time from, and the job
        monkeypatch.setattr(module, "time", clock)
    cfg, job = load_config(None, [*BASE, *DELAYS])
    command, folder = goodput.Command(started=clock.now), RunFolder(tmp_path)  # a command's record, as a driver
    goodput.begin(folder, command)
    runtime = make_runtime("cpu", "fp32", 1, 0, 0)
    Trainer(cfg, job, runtime, tmp_path, tmp_path, FolderReporter(tmp_path), command=command).fit()
    goodput.end(folder, command, "completed")
    record = breakdown_of(tmp_path)
    evaluation = 2 * 16 * 0.004  # an evaluation at each epoch's end loads the valid split's 16 samples
    expected = {**INJECTED, "evaluation": evaluation}
    categories = record["categories"]
    # to the clock's float rounding at epoch seconds; a misplaced delay would move 4 ms or more
    assert {name: categories[name] for name in expected} == pytest.approx(expected, abs=1e-4), categories
    assert sum(categories.values()) == pytest.approx(record["wall_s"], rel=1e-9)
    assert record["wall_s"] == pytest.approx(clock.now - command.started, abs=1e-4)
    assert record["goodput"] == pytest.approx(categories["productive"] / record["wall_s"])
    assert record["commands"][0]["outcome"] == "completed" and len(record["commands"][0]["attempts"]) == 1


def test_a_profile_traces_exactly_the_chosen_steps_with_the_model_s_ops(tmp_path):
    cfg, job = load_config(None, [*BASE, "--profile", "3:5"])
    assert cfg.loop.profile_steps == [3, 5]
    Trainer(cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), tmp_path, tmp_path, FolderReporter(tmp_path)).fit()
    marks, names = traced_steps(tmp_path / "profile" / "rank_0.pt.trace.json")
    assert marks == {"raytpu step 3", "raytpu step 4", "raytpu step 5"}
    assert "aten::addmm" in names and "aten::tanh" in names  # the toy model's Linear and Tanh


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (["--profile", "5:3"], "loop.profile_steps must be [first, last] steps with 1 <= first <= last"),
        (["--profile", "x"], "--profile x: give the steps to trace as FIRST:LAST"),
        (["loop.profile_steps=[1,2]", "loop.profile_ranks=[3]"], "loop.profile_ranks [3] are not ranks of the 1"),
    ],
)
def test_a_profile_window_that_cannot_be_is_one_line(flag, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [*BASE, *flag])


#: a script's loop under Accelerate with the launch's profile hooked in: 8 micro-batches, 2 accumulated
ACCUMULATING_SCRIPT = """
import sys
import torch
from accelerate import Accelerator
from raytpu.runtime.profiling import ScriptProfile

profile = ScriptProfile("cpu", sys.argv[1], 0, (2, 3), done=lambda: print("written"))
profile.install()
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(8):
    with accelerator.accumulate(model):
        accelerator.backward(model(torch.randn(2, 4)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
profile.remove()
print("steps", profile.steps)
"""


def test_a_launched_script_s_optimizer_steps_are_the_profile_s_steps_accumulation_counting_once(tmp_path):
    """``raytpu launch --profile 2:3`` counts what Accelerate steps: 8 micro-batches accumulated 2 at
    a time are 4 optimizer steps; the window holds steps 2 and 3, the script's ops in them. (In its
    own process: Accelerate picks XLA at import unless USE_TORCH_XLA=0, as ``raytpu launch`` sets.)"""
    script = tmp_path / "script.py"
    script.write_text(ACCUMULATING_SCRIPT)
    done = run_python([str(script), str(tmp_path)], {"USE_TORCH_XLA": "0"}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["written", "steps", "4"]
    marks, names = traced_steps(tmp_path / "rank_0.pt.trace.json")
    assert marks == {"raytpu step 2", "raytpu step 3"}
    assert "aten::tanh" in names


def test_a_profile_window_the_script_never_reaches_says_so(tmp_path, capsys):
    from raytpu.runtime.profiling import ScriptProfile

    profile = ScriptProfile("cpu", tmp_path, 0, (5, 6), done=lambda: None)
    profile.install()
    torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1).step()
    profile.remove()
    assert capsys.readouterr().err.strip() == (
        "raytpu: warning: --profile 5:6: the script made 1 optimizer step(s) in this process; nothing was traced"
    )
    assert not list(tmp_path.iterdir())
