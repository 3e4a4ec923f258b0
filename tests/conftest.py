"""Shared fixtures: one local Ray instance for the whole session (starting Ray costs ~5-30 s), one per
test process when pytest-xdist runs two (scripts/test.sh), each with its own storage servers."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the line tests/xla_probe.py prints once a run's model is prepared, before its first step: what
#: raytpu decided (wrapping, shardings) is then known even where torch_xla kills the process in a step
PREPARED = "PREPARED "
#: where tests/xla_probe.py puts the folders of its unnamed runs (else in /tmp)
PROBE_RUNS = "RAYTPU_XLA_PROBE_RUNS"

#: torch_xla on the CPU PJRT device (in this process, its subprocesses and the Ray workers it
#: starts) compiles with LLVM at -O0 and XLA's older CPU fusion code generator: what the tests check
#: (which graphs compile, how often, CPU fallbacks, values) is the same; -O0 cut compiling MSHNet's
#: step to about a quarter, and the older generator a cut-down MSHNet probe run from 23-25 s to 15-16 s
FAST_CPU_COMPILE = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false"}
for flag, value in FAST_CPU_COMPILE.items():
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{flag}={value}".strip()

#: two test processes share the two cores (scripts/test.sh): with torch's two OpenMP threads in each,
#: four threads spun against each other for two cores (a third of the CPU in the kernel, and the
#: learning tests 5 to 8 times slower side by side); Ray's workers already run one thread each
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

#: Ray Train's controller polls its workers every 2 s: a run's end, or a worker's failure, is seen up
#: to 2 s late, on every one of the suite's Ray Train runs (read by the controller actor, so set
#: before the session's Ray instance and the Ray heads that tests start)
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")


#: the test files that take a test process longest (a minute or more, longest first; measured in a
#: clean clone, and the newer files alone), collected first. pytest-xdist hands out whole files in
#: collection order (scripts/test.sh: --dist loadfile --no-loadscope-reorder), so the short files
#: come last and even out the ends of the two processes; handed out by number of tests instead, a
#: 2-minute learning test came last and the other process sat idle for 3 minutes of a 20-minute suite
LONGEST_FIRST = (
    "test_multinode.py",
    "test_launch.py",
    "test_task_pages.py",
    "test_tune.py",
    "test_autoscaling.py",
    "test_integration_ray.py",
    "test_corpus_ray.py",
    "test_buckets.py",
    "test_tracking.py",
    "test_faults.py",
    "test_sft.py",
    "test_sharding.py",
    "test_notebook.py",
    "test_mshnet_learning.py",
    "test_cdeit_learning.py",
    "test_submit.py",
    "test_causal_lm.py",
    "test_xla.py",
    "test_architectures.py",
    "test_full_disk.py",
    "test_mesh.py",
    "test_hub.py",
    "test_compile.py",
    "test_scan.py",
    "test_fsdp.py",
    "test_batch_finder.py",
    "test_own_job.py",
    "test_ingest_ray.py",
    "test_local.py",
    "test_packaging.py",
    "test_runtimes.py",
    "test_float8.py",
    "test_corpus.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept
    for item in items:  # a test on the session's Ray is an integration test (scripts/test.sh --fast leaves it out)
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session", autouse=True)
def probe_runs(tmp_path_factory) -> None:
    """The folder of the XLA probes' unnamed runs (``tests/xla_probe.py``, run in subprocesses that
    inherit this process's environment): the session's temporary folder, not ``/tmp``, where each
    suite left about 70 MB of checkpoints."""
    os.environ[PROBE_RUNS] = str(tmp_path_factory.mktemp("xla-probe-runs"))


@pytest.fixture(scope="session")
def stores():
    """The S3 and GCS servers on loopback, with the bucket ``tests.stores.BUCKET`` on each."""
    from tests.stores import start_stores

    started = start_stores()
    yield started
    started.stop()


@pytest.fixture(scope="session")
def ray_session(stores):
    """One local Ray instance for the session, started after the storage servers so that its
    workers read their endpoints and keys from the environment, as a cloud VM's do. Without Ray's
    dashboard, which no test reads there and which takes a tenth of a core while it runs (the
    clusters that jobs are submitted to start theirs)."""
    import ray

    from raytpu.cluster.connect import connect

    assert not ray.is_initialized(), "an earlier command left its Ray instance running (it would miss the stores)"
    os.environ.pop("RAY_ADDRESS", None)
    connect("local", dashboard=False)  # a fresh instance even when another Ray runs on this machine
    yield ray
    ray.shutdown()


@pytest.fixture
def one_thread():
    """Small convolutions: one torch thread is fast enough, and immune to a busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: XLA's C++ log level as the suite was started with it: torch_xla, once imported in a test process,
#: sets its own default there, which a fresh process must not inherit as if its user had set it
LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
LOG_LEVEL_GIVEN = os.environ.get(LOG_LEVEL)


def start_python(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python args`` from the repo root in a fresh process (XLA settings are per process)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    if LOG_LEVEL_GIVEN is None and LOG_LEVEL not in (env or {}):
        full_env.pop(LOG_LEVEL, None)
    return subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(process: subprocess.Popen, timeout: int = 900) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@functools.cache
def pid_namespace_refusal() -> str:
    """Why this machine runs no process in a PID namespace of its own ("" where it does)."""
    try:
        done = subprocess.run(["unshare", "-fp", "--mount-proc", "true"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return "unshare (util-linux) is not installed"
    return "" if done.returncode == 0 else f"unshare -fp --mount-proc is refused here ({done.stderr.strip()})"


def in_own_pid_namespace(command: list[str]) -> list[str]:
    """``command`` in a PID namespace of its own (its Ray cluster's processes end with it, and no
    ``ray stop`` of it reaches the session's); the test skips, saying why, where that is not allowed."""
    refusal = pid_namespace_refusal()
    if refusal:
        pytest.skip(f"needs a PID namespace of its own (root, or unprivileged user namespaces): {refusal}")
    return ["unshare", "-fp", "--mount-proc", *command]


def run_python(args: list[str], env: dict[str, str] | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return finish(start_python(args, env), timeout)


class XlaProbe:
    """``tests.xla_probe`` (3 warm-up steps a run) with ``runs`` in one process on ``devices``
    XLA CPU devices. It starts at once: two probes compile side by side on the machine's two
    cores, where one alone leaves a core idle for much of its time."""

    def __init__(self, devices: int, *runs: list[str], env: dict[str, str] | None = None) -> None:
        args = ["-m", "tests.xla_probe", "3"]
        for index, overrides in enumerate(runs):
            args += (["--"] if index else []) + overrides
        self.runs = len(runs)
        xla = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "PYTHONFAULTHANDLER": "1"}  # a crash's stack
        self.process = start_python(args, {**xla, **(env or {})})
        self._done: subprocess.CompletedProcess | None = None

    def done(self) -> subprocess.CompletedProcess:
        if self._done is None:
            self._done = finish(self.process)
        return self._done

    def crash(self) -> str:
        """What killed the process, where a signal did ("" where it ended by itself)."""
        done = self.done()
        return f"signal {-done.returncode}: {fault_stacks(done.stderr)}" if done.returncode < 0 else ""

    def prepared(self) -> list[dict]:
        """How each run that got to its first step prepared its model, also where the process crashed."""
        lines = self.done().stdout.splitlines()
        return [json.loads(line.removeprefix(PREPARED)) for line in lines if line.startswith(PREPARED)]

    def reports(self) -> list[dict]:
        """One report a run, once the process has ended."""
        done = self.done()
        assert done.returncode == 0, self.crash() or done.stderr[-3000:]
        reports = [json.loads(line) for line in done.stdout.strip().splitlines() if line.startswith("{")]
        assert len(reports) == self.runs, done.stdout[-3000:]
        return reports


def fault_stacks(stderr: str, limit: int = 6000) -> str:
    """The fatal error and every thread's stack that faulthandler printed, without its list of
    extension modules."""
    start = stderr.find("Fatal Python error")
    end = stderr.find("Extension modules", start)
    return stderr[max(start, 0) : end if end > 0 else None][-limit:]


def tensorboard_hparams(log_dir: Path) -> tuple[dict[str, object], list[str]]:
    """What TensorBoard's HPARAMS tab shows for the run in ``log_dir``: its values and metric tags."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(log_dir))
    events.Reload()
    content = {
        tag: plugin_data_pb2.HParamsPluginData.FromString(raw)
        for tag, raw in events.PluginTagToContent("hparams").items()
    }
    start = content["_hparams_/session_start_info"].session_start_info.hparams
    values = {key: getattr(value, value.WhichOneof("kind")) for key, value in start.items()}
    metrics = [info.name.tag for info in content["_hparams_/experiment"].experiment.metric_infos]
    return values, metrics


def traced_steps(trace_file: Path) -> tuple[set[str], set[str]]:
    """The step marks in a Chrome trace, and all its event names."""
    names = {event.get("name", "") for event in json.loads(trace_file.read_text())["traceEvents"]}
    return {name for name in names if name.startswith("raytpu step ")}, names
