"""``raytpu launch``: an existing Accelerate (or plain ``torch.distributed``) script, unchanged, on
Ray Train workers.

The driver side: the options (named as ``accelerate launch`` names them where the meaning is
shared), the checks that refuse a launch which can never fit, a ``TorchTrainer`` whose workers
run the script as ``__main__`` (``raytpu.worker.script``), and the run's outcome: the script's exit
status becomes the command's. Scripts may call :func:`report` to send metrics to Ray (a no-op
when the script runs without ``raytpu launch``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytpu.config import CheckpointSettings, Config, RunSettings, ScalingSettings, build_dataclass, with_values
from raytpu.config.loading import expand_file_ranges, profile_window
from raytpu.config.plan import Plan, ScriptPlan
from raytpu.config.training_args import ACCELERATE_PRECISIONS
from raytpu.config.validation import check_number, check_profile
from raytpu.errors import ConfigError, RunFailed
from raytpu.records import goodput
from raytpu.records.goodput import Command
from raytpu.runtime.kinds import kind_of
from raytpu.storage.filesystems import join
from raytpu.storage.run_folder import RunFolder

#: what scripts and tests import from here: ``report`` and the names of the launch environment
LAUNCH_TEXT = "run an existing Accelerate / torch.distributed script, unchanged, on Ray Train workers"


def add_launch_arguments(launch: argparse.ArgumentParser) -> None:
    """``raytpu launch``'s options (also read by ``raytpu submit launch``)."""
    launch.add_argument("--num_processes", type=int, help="processes (Ray workers), default 1")
    launch.add_argument("--mixed_precision", help="no | fp16 | bf16 | fp8 | auto (default: the script's own)")
    launch.add_argument("--gradient_accumulation_steps", type=int, help="Accelerate's (default 1)")
    launch.add_argument("--runtime", help="cpu | cuda | xla | auto (default: auto, from the cluster)")
    launch.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray instance)")
    launch.add_argument("--tpu-accelerator-type", help="TPU slice type, e.g. TPU-V5LITEPOD (one process per chip)")
    launch.add_argument("--tpu-topology", help="TPU slice topology, e.g. 2x4")
    launch.add_argument("--max-failures", type=int, help="restarts after lost processes (default 0; -1: always)")
    launch.add_argument("--name", help="run name (default: the script's stem); the same name resumes")
    launch.add_argument("--storage-path", help="where runs are kept (default ./results)")
    launch.add_argument("--cpus-per-worker", type=float, help="CPUs each process reserves (default 1)")
    launch.add_argument("--config", help="YAML with scaling:, run: and checkpoint: sections (as raytpu train)")
    launch.add_argument(
        "--profile", help="trace the script's optimizer steps FIRST:LAST on rank 0 (into <run>/profile)"
    )
    launch.add_argument("--verbose", action="store_true", help="show Ray's own log lines too")
    launch.add_argument("script", help="the training script, e.g. examples/accelerate/train.py")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments, untouched")


@dataclass(frozen=True)
class LaunchSettings:
    """Everything ``raytpu launch`` was asked, checked on the driver: the script, and the config
    that schedules it (its ``scaling``, ``run`` and ``checkpoint`` sections)."""

    script: str
    script_args: tuple[str, ...] = ()
    config: Config = field(default_factory=Config)
    mixed_precision: str = ""  # no | fp16 | bf16 | fp8 | auto; "": the script's own (Accelerator's argument, else no)
    gradient_accumulation_steps: int = 1

    @property
    def scaling(self) -> ScalingSettings:
        return self.config.scaling

    @property
    def run(self) -> RunSettings:
        return self.config.run


#: ``raytpu launch`` options -> the config keys they set
FLAG_KEYS = {
    "num_processes": "scaling.num_workers",
    "runtime": "scaling.runtime",
    "cpus_per_worker": "scaling.cpus_per_worker",
    "name": "run.name",
    "storage_path": "run.storage_path",
    "max_failures": "checkpoint.max_failures",
}


def settings_from(args: Any) -> LaunchSettings:
    """The parsed ``raytpu launch`` arguments (and ``--config``'s sections), checked."""
    sections = read_sections(args.config) if args.config else {}
    expand_file_ranges(sections)
    cfg = Config(
        scaling=build_dataclass(ScalingSettings, sections.get("scaling"), "scaling."),
        run=build_dataclass(RunSettings, sections.get("run"), "run."),
        checkpoint=build_dataclass(CheckpointSettings, sections.get("checkpoint"), "checkpoint."),
    )
    values = {key: getattr(args, flag) for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None}
    if args.tpu_accelerator_type:  # Accelerate has no SPMD mode: one process per chip
        values.update({"scaling.tpu.accelerator_type": args.tpu_accelerator_type, "scaling.tpu.layout": "multiprocess"})
        values["scaling.tpu.topology"] = args.tpu_topology or ""
    if args.profile is not None:
        values.update(profile_window(args.profile))
    values["logging.verbose"] = bool(args.verbose)
    if args.mixed_precision:
        values["scaling.precision"] = ACCELERATE_PRECISIONS.get(args.mixed_precision, args.mixed_precision)
    if not (values.get("run.name") or cfg.run.name):
        values["run.name"] = Path(args.script).stem
    settings = LaunchSettings(
        script=args.script,
        script_args=tuple(args.script_args),
        config=with_values(cfg, values),
        mixed_precision=args.mixed_precision or "",
        gradient_accumulation_steps=args.gradient_accumulation_steps or 1,
    )
    check(settings)
    return settings


def read_sections(path: str) -> dict[str, Any]:
    from raytpu.config import read_yaml

    if not Path(path).is_file():
        raise ConfigError(f"--config {path!r} not found; pass a YAML file with a scaling: section")
    raw = read_yaml(Path(path)) or {}
    unknown = sorted(set(raw) - {"scaling", "run", "checkpoint"})
    if unknown:
        raise ConfigError(
            f"--config {path}: raytpu launch reads the scaling, run and checkpoint sections, not {unknown}"
        )
    return raw


def check(settings: LaunchSettings) -> None:
    script = Path(settings.script)
    if not script.is_file():
        raise ConfigError(f"script {settings.script!r} not found; give the path of the training script to run")
    if settings.mixed_precision and settings.mixed_precision not in ACCELERATE_PRECISIONS:
        choices = ", ".join(ACCELERATE_PRECISIONS)
        raise ConfigError(f"--mixed_precision {settings.mixed_precision!r} is not one of {choices}")
    if settings.scaling.runtime != "auto":
        try:
            kind_of(settings.scaling.runtime)
        except ConfigError as exc:
            raise ConfigError(in_launch_words(str(exc))) from None
    check_number("--num_processes", settings.scaling.num_workers, (1, True))
    if settings.scaling.min_workers:
        raise ConfigError(
            f"raytpu launch runs a script that owns its world size: scaling.num_workers="
            f"{settings.scaling.min_workers}:{settings.scaling.num_workers} (an elastic range) is for raytpu train; "
            "give one size (--num_processes N)"
        )
    check_number("--gradient_accumulation_steps", settings.gradient_accumulation_steps, (1, True))
    check_number("--cpus-per-worker", settings.scaling.cpus_per_worker, (0, True))
    check_number("--max-failures", settings.config.checkpoint.max_failures, (-1, True))
    check_profile(settings.config.loop.profile_steps, settings.config.loop.profile_ranks, settings.scaling.num_workers)


# ------------------------------------------------------------------ the run
def main(args: Any, address: str | None, started: float | None = None) -> int:
    """``raytpu launch``: run the script on Ray Train workers; the script's exit status. Its time
    goes into the run's ``goodput.json`` as a ``raytpu train``'s does: start-up to the script's
    start on rank 0, the script, and the end (``started``: when the command started)."""
    from raytpu.cluster.connect import ray_for_this_command

    settings = settings_from(args)
    command, marks = Command(started=started or time.time()), {}
    folder, outcome = None, "failed"
    try:
        with ray_for_this_command():
            plan = plan_launch(settings, address, marks, command)
            folder = RunFolder(plan.run_dir)
            goodput.begin(folder, command)
            code = launch_on_ray(plan, marks)
            outcome = "completed" if code == 0 else "failed"
        return code
    finally:
        if folder is not None:
            with contextlib.suppress(OSError):  # a store that stopped answering keeps the record it has
                goodput.end(folder, command, outcome, marks)


def plan_launch(settings: LaunchSettings, address: str | None, marks: dict[str, float], command: Command) -> Plan:
    """The launch prepared as every command is (:func:`raytpu.driver.commands.prepare`): the
    script's plan beside the run's; ``marks`` gets when the driver began and ended joining Ray."""
    from raytpu.driver.commands import prepare

    script = ScriptPlan(
        path=str(Path(settings.script).resolve()),
        args=settings.script_args,
        working_dir=os.getcwd(),
        mixed_precision=settings.mixed_precision,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        state=f"raytpu-launch-{uuid.uuid4().hex[:12]}",
    )
    try:
        return prepare(settings.config, "launch", address=address, command=command, script=script, marks=marks)
    except ConfigError as exc:
        raise ConfigError(in_launch_words(str(exc))) from None


#: the config keys a refusal names -> the ``raytpu launch`` option that sets them
OPTION_OF = {
    "scaling.num_workers=": "--num_processes ",
    "scaling.runtime=": "--runtime ",
    "scaling.cpus_per_worker=": "--cpus-per-worker ",
    "scaling.precision=fp8": "--mixed_precision fp8",
    "scaling.precision=bf16": "--mixed_precision bf16",
}


def in_launch_words(message: str) -> str:
    """A refusal written for ``raytpu train`` in the options of ``raytpu launch`` (whose script
    batches as it likes: no global batch to keep)."""
    message = message.replace(" (the global batch stays the same)", "").replace("the global batch stays the same; ", "")
    for key, option in OPTION_OF.items():
        message = message.replace(key, option)
    return message


def launch_on_ray(plan: Plan, marks: dict[str, float]) -> int:
    """The launch's ``TorchTrainer`` to the end; the script's exit status (its own error: one line).
    ``marks`` gets when the trainer was started and when it returned."""
    import ray
    from ray.train import TrainingFailedError

    from raytpu.driver.ray_trainer import build_trainer, fit, root_cause, wait_for_workers
    from raytpu.records.relay import LaunchState

    assert plan.script is not None
    wait_for_workers(plan)
    state = ray.remote(num_cpus=0)(LaunchState).options(name=plan.script.state).remote(plan.script.last_checkpoint)
    marks["fit"] = time.time()
    try:
        with ConsoleRelay(state):
            fit(build_trainer(plan))
    except TrainingFailedError as exc:
        if ray.get(state.failure.remote()) is None:  # a lost process, retried up to --max-failures
            raise RunFailed(*root_cause(exc)) from exc
    finally:
        marks["fitted"] = time.time()
    failure = ray.get(state.failure.remote())
    print(f"raytpu: logs of every process: {join(plan.run_dir, 'logs')}", flush=True)
    if failure is None:
        return 0
    rank, code, details = failure
    if code == 1 and details:
        last = details.strip().splitlines()[-1]
        raise RunFailed(f"rank {rank}: {last}", details)
    print(f"raytpu: rank {rank} exited with status {code}", file=sys.stderr, flush=True)
    return code


class ConsoleRelay:
    """Rank 0's output on this console as its script wrote it, while the block runs: taken from
    the run's :class:`~raytpu.records.relay.LaunchState` every tenth of a second by a thread,
    and what is left once the block ends."""

    def __init__(self, state: Any, every_s: float = 0.1) -> None:
        self.state, self.every_s = state, every_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._relay, daemon=True)

    def __enter__(self) -> ConsoleRelay:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        self.thread.join()
        self._write()

    def _relay(self) -> None:
        while not self.done.wait(self.every_s):
            self._write()

    def _write(self) -> None:
        import ray

        for stream, chunk in ray.get(self.state.take_output.remote()):
            out = sys.stdout if stream == 1 else sys.stderr
            out.flush()
            if hasattr(out, "buffer"):
                out.buffer.write(chunk)
                out.buffer.flush()
            else:  # a text stream put in its place (redirect_stdout)
                out.write(chunk.decode(errors="replace"))
