"""The worker side of ``raytpu launch``: one Ray Train worker runs the user's script as ``__main__``.

Before the script starts, each worker gets the environment Accelerate and ``torch.distributed``
expect (Ray's ``TorchConfig`` has already joined the processes in a process group and set
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``):

* cpu: ``USE_TORCH_XLA=0`` (Accelerate would pick its XLA mode whenever torch_xla imports) and
  ``ACCELERATE_USE_CPU=true`` (so that it distributes over the gloo group, not one process each);
* cuda: ``USE_TORCH_XLA=0``; Ray sets the device (``ACCELERATE_TORCH_DEVICE``) and NCCL;
* xla: the per-chip PJRT environment of ``raytpu.runtime.tpu`` on a TPU slice, so that Accelerate reads
  world size and ordinal from torch_xla.

``ACCELERATE_MIXED_PRECISION`` and ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS`` carry the launch
options; on XLA an fp16 request in the script's own ``Accelerator(...)`` becomes bf16 with a
warning. Checkpoints: when rank 0's ``accelerator.save_state(dir)`` returns, the directory is
published to the run's :class:`LaunchState` actor, and a thread on *every* worker reports each
published entry through the worker's reporter (``raytpu.worker.reporting``; a Ray Train report
is a barrier: all workers report the same entries, in their own threads, so a script that saves
on its main process only never blocks, and no worker waits on another's training code). A
restarted worker finds the reporter's latest checkpoint in ``RAYTPU_RESUME_FROM`` and
``accelerator.load_state()`` reads it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import runpy
import select
import sys
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from raytpu.config.plan import Plan, ScriptPlan
from raytpu.records.relay import RESUME_ENV, STATE_ENV
from raytpu.runtime.kinds import RuntimeKind, kind_of
from raytpu.storage.run_folder import RunFolder
from raytpu.worker.reporting import Reporter

#: seconds between copies of the processes' logs to a bucket run folder (and at the end)
LOG_SYNC_S = 10.0


def report(metrics: dict[str, Any]) -> None:
    """Send ``metrics`` (numbers) to Ray Train from a launched script's main process; outside
    ``raytpu launch`` it does nothing, so a script keeps running under ``python`` or
    ``accelerate launch``."""
    name = os.environ.get(STATE_ENV)
    if not name or os.environ.get("RANK", "0") != "0":
        return
    import ray

    ray.get_actor(name).publish.remote("metrics", {k: float(v) for k, v in metrics.items()})


def run_script_worker(plan: Plan, seat: Any, reporter: Reporter) -> None:
    """One worker of ``raytpu launch`` (``raytpu.worker.entry.work``): the script, its output,
    checkpoints and outcome."""
    import ray

    entered = time.time()
    script, rank = plan.script, seat.rank
    assert script is not None
    state = ray.get_actor(script.state)
    if ray.get(state.failure.remote()) is not None:
        return  # the script failed in an earlier attempt: a script's own error is never retried
    folder = RunFolder(plan.run_dir)
    log = f"logs/rank_{rank}.log"
    folder.local("logs")
    restore_output = capture_output(folder.local() / log, console=state if rank == 0 else None)
    kind = kind_of(plan.config.scaling.runtime)
    os.environ.update(process_environment(script, kind))
    patch_accelerate(kind, script.state, rank)
    resume = reporter.latest_checkpoint()
    if resume is not None:
        os.environ[RESUME_ENV] = str(resume)
    ray.get(state.register.remote(rank, ray.get_runtime_context().current_actor))
    # entries of an earlier attempt were reported then, or lost with it: report only new ones
    first = ray.get(state.size.remote())
    publisher = threading.Thread(target=report_published, args=(state, reporter, first, folder, log), daemon=True)
    publisher.start()
    profile = script_profile(plan, rank, folder)
    began = time.time()
    code, details = run_script(script)
    if profile is not None:
        profile.remove()
    if rank == 0 and plan.facts.command:
        record_script_time(folder, plan, (entered, began), final=code == 0)
    restore_output()
    folder.sync(log)
    if code and peer_lost(state, rank):
        raise RuntimeError(f"rank {rank}: a peer process was lost (this rank's error follows from it):\n{details}")
    if code:
        ray.get(state.fail.remote(rank, code, details))
        raise RuntimeError(f"the script exited with status {code}" + (f":\n{details}" if details else ""))
    ray.get(state.finish.remote(rank))
    publisher.join()


def record_script_time(folder: RunFolder, plan: Plan, times: tuple[float, float], final: bool) -> None:
    """Rank 0's script run as an attempt of the run's goodput record: from the script's start to
    its end, all of it productive (raytpu cannot see inside a script's steps). ``times``: when this
    worker began, and when the script started."""
    from raytpu.records.goodput import Command, record_attempt

    entered, began = times
    attempt = {"id": uuid.uuid4().hex[:12], "entered": entered, "first_step": began, "recorded": time.time()}
    record_attempt(folder, Command(plan.facts.command, plan.facts.started), {**attempt, "final": final, "seconds": {}})


def script_profile(plan: Plan, rank: int, folder: RunFolder) -> Any:
    """``--profile FIRST:LAST`` on this rank: the script's optimizer steps traced into ``<run>/profile``
    (a :class:`~raytpu.runtime.profiling.ScriptProfile`), or None."""
    from raytpu.runtime.profiling import ScriptProfile  # torch: on the workers only

    loop = plan.config.loop
    if not loop.profile_steps or rank not in loop.profile_ranks:
        return None
    first, last = loop.profile_steps
    profile = ScriptProfile(plan.config.scaling.runtime, folder.local("profile"), rank, (first, last),
                            done=lambda: folder.sync("profile"))  # fmt: skip
    profile.install()
    return profile


def peer_lost(state: Any, rank: int, timeout_s: float = 10.0) -> bool:
    """Whether another worker of this attempt is gone: a script that fails because a peer was
    killed (a collective that lost its peer) is not the script's own error, and Ray Train may
    restart the group (``--max-failures``); one that fails with every peer alive ends the run."""
    import ray

    for actor in ray.get(state.peers.remote(rank)):
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return True
    return False


def run_script(script: ScriptPlan) -> tuple[int, str]:
    """Run the script as ``__main__`` with its own argv, directory and imports: (status, traceback)."""
    os.chdir(script.working_dir)
    sys.argv = [script.path, *script.args]
    sys.path.insert(0, str(Path(script.path).parent))
    try:
        with fresh_root_logger():
            runpy.run_path(script.path, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        return code, "" if isinstance(exit_.code, int) or exit_.code is None else str(exit_.code)
    except BaseException as exc:  # the script's own error: its traceback, then the run ends
        return 1, script_traceback(exc, script.path)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0, ""


def script_traceback(exc: BaseException, path: str) -> str:
    """``exc``'s traceback from the script's own first frame on, as Python prints it when it runs
    the script itself (without the frames of raytpu and runpy that ran it)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


@contextlib.contextmanager
def fresh_root_logger() -> Iterator[None]:
    """The root logger as a new Python process has it (no handler, level WARNING) while the script
    runs: a Ray worker's root logger carries Ray's handlers, so the script's own
    ``logging.basicConfig(format=..., level=..., handlers=...)`` would do nothing."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    for handler in handlers:
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


def process_environment(script: ScriptPlan, kind: RuntimeKind) -> dict[str, str]:
    """What a launched process adds to its environment: the launch options for Accelerate, and what
    its runtime's description tells Accelerate and Transformers (on or off XLA, the CPU). On a TPU
    slice the chip's PJRT environment is already set (the description's ``prepare_process``)."""
    env = {
        STATE_ENV: script.state,
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": str(script.gradient_accumulation_steps),
    }
    if script.mixed_precision:  # else the script's Accelerator(mixed_precision=...) decides, as under accelerate launch
        env["ACCELERATE_MIXED_PRECISION"] = script.mixed_precision
        if script.mixed_precision == "fp8":
            env["ACCELERATE_FP8_BACKEND"] = "AO"  # torchao's float8 layers, as scaling.precision=fp8 trains
    return {**env, **kind.accelerate_env()}  # the driver's own USE_TORCH_XLA=0 must not reach an XLA worker


def patch_accelerate(kind: RuntimeKind, state_name: str, rank: int) -> None:
    """Hooks on Accelerate's ``Accelerator`` for launched scripts (only when it is installed):
    fp16 -> bf16 on XLA, ``save_state`` published, ``log`` forwarded, ``load_state()`` resuming."""
    try:
        from accelerate import Accelerator
    except ImportError:
        return
    import ray

    init, save_state, load_state, log = (
        Accelerator.__init__,
        Accelerator.save_state,
        Accelerator.load_state,
        Accelerator.log,
    )

    def patched_init(self: Any, *args: Any, **kwargs: Any) -> None:
        xla = kind.accelerate_fp16_as_bf16()
        if xla and kwargs.get("mixed_precision") == "fp16":
            warnings.warn("mixed_precision fp16 is not supported on XLA/TPU; using bf16 instead", stacklevel=2)
            kwargs["mixed_precision"] = "bf16"
        init(self, *args, **kwargs)
        if xla and self.state.mixed_precision == "bf16":
            # Accelerate autocasts bf16 only where it finds a TPU (elsewhere on XLA it relies on
            # the deprecated XLA_USE_BF16): torch.autocast("xla", bfloat16) on every XLA device
            self.native_amp = True

    def patched_save_state(self: Any, output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        saved = save_state(self, output_dir, *args, **kwargs)
        if rank == 0:
            ray.get_actor(state_name).publish.remote("checkpoint", str(Path(saved or output_dir).resolve()))
        return saved

    def patched_load_state(self: Any, input_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        return load_state(self, input_dir or os.environ.get(RESUME_ENV), *args, **kwargs)

    def patched_log(self: Any, values: dict, *args: Any, **kwargs: Any) -> Any:
        report({k: v for k, v in values.items() if isinstance(v, (int, float))})
        return log(self, values, *args, **kwargs)

    Accelerator.__init__ = patched_init
    Accelerator.save_state = patched_save_state
    Accelerator.load_state = patched_load_state
    Accelerator.log = patched_log


def report_published(state: Any, reporter: Reporter, first: int, folder: RunFolder, log: str) -> None:
    """Report every published entry through the worker's reporter, in order, on every worker (rank
    0 with the checkpoint directory, which stays the script's), until every rank finished and
    nothing is left; meanwhile copy this process's log to a bucket run folder every few seconds."""
    import ray

    done, metrics, synced = first, {}, time.monotonic()
    while True:
        entries, final = ray.get(state.poll.remote(done, reporter.world, reporter.rank))
        for kind, value in entries:
            done += 1
            if kind == "metrics":
                metrics = {**metrics, **value}
                reporter.report({**metrics, "published": done}, None, "")
                continue
            directory, name = value
            mine = Path(directory) if reporter.rank == 0 else None
            reporter.report({**metrics, "published": done}, mine, name, owned=False)
        if final:
            return
        if time.monotonic() - synced > LOG_SYNC_S:
            folder.sync(log)
            synced = time.monotonic()
        time.sleep(0.2)


def capture_output(log_file: Path, console: Any = None) -> Callable[[], None]:
    """This process's stdout and stderr (fd 1 and 2, so C++ output too) into ``log_file``; with
    ``console`` (the run's :class:`LaunchState`, on rank 0) also to the driver's console, byte for
    byte (a progress bar's ``\\r`` kept), through pipes read by one thread in the order the output
    comes: not through Ray's log streaming, which splits output into prefixed lines. Returns what
    puts them back (and waits for the copy to finish)."""
    log = open(log_file, "ab", buffering=0)  # noqa: SIM115 (closed by the returned function)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    pipes: dict[int, int] = {}
    for fd in (1, 2):
        if console is None:
            os.dup2(log.fileno(), fd)
            continue
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        pipes[read] = fd
    copier = threading.Thread(target=copy_output, args=(pipes, console, log), daemon=True) if pipes else None
    if copier is not None:
        copier.start()

    def restore() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in saved.items():
            os.dup2(original, fd)  # closes the pipes' write ends: the copy reaches their ends
            os.close(original)
        if copier is not None:
            copier.join(timeout=10)
        log.close()

    return restore


def copy_output(pipes: dict[int, int], console: Any, log: Any) -> None:
    """Each chunk from the ``pipes`` (read end -> the stream it stands for) to the log file and to
    the driver's console, one at a time in the order they can be read (stdout first when both can),
    until both are closed."""
    import ray

    while pipes:
        ready, _, _ = select.select(sorted(pipes, key=pipes.get), [], [])
        for read in sorted(ready, key=pipes.get):
            chunk = os.read(read, 65536)
            if not chunk:
                os.close(read)
                del pipes[read]
                continue
            ray.get(console.write.remote(pipes[read], chunk))
            log.write(chunk)
