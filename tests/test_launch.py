"""``raytpu launch``: Accelerate's own distributed tests and the example script, unchanged, on 2
local Ray CPU workers; the example on the XLA CPU device; restarts; one-line errors."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import accelerate
import pytest
import torch
from safetensors.torch import load_file

from raytpu import cli
from tests.conftest import ROOT, traced_steps

EXAMPLE = str(ROOT / "examples" / "accelerate" / "train.py")
ACCELERATE_SCRIPTS = Path(accelerate.__file__).parent / "test_utils" / "scripts"


def launch(tmp_path: Path, name: str, *argv: str) -> int:
    return cli.main(["launch", "--storage-path", str(tmp_path / "runs"), "--name", name, *argv])


def log_of(tmp_path: Path, name: str, rank: int = 0) -> str:
    return (tmp_path / "runs" / name / "logs" / f"rank_{rank}.log").read_text()


def final_weights(results: Path) -> dict[str, torch.Tensor]:
    return load_file(results / "final.safetensors")


# ------------------------------------------------------------------ no Ray needed
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["launch", "nowhere.py"], "script 'nowhere.py' not found"),
        (["launch", "--mixed_precision", "fp4", EXAMPLE], "--mixed_precision 'fp4' is not one of no, fp16, bf16, fp8"),
        (["launch", "--mixed_precision", "fp8", EXAMPLE], "--mixed_precision fp8 needs NVIDIA GPUs with float8"),
        (["launch", "--num_processes", "0", EXAMPLE], "--num_processes must be at least 1"),
        (["launch", "--runtime", "tpu", EXAMPLE], "--runtime 'tpu' is not one of auto, cpu, cuda, xla"),
        (["launch", "--num_processes", "two", EXAMPLE], "argument --num_processes/--num-processes: invalid int"),
        (["launch"], "the following arguments are required: script"),
        (["launch", "--config", "nope.yaml", EXAMPLE], "--config 'nope.yaml' not found"),
        (["launch", "--storage-path", "hdfs://nn/runs", EXAMPLE], "use a local folder, gs://bucket/prefix or s3://"),
    ],
)
def test_bad_launches_are_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("raytpu: error: ") and "\n" not in err and message in err, err


def test_a_config_file_gives_the_scaling_and_an_unknown_section_is_refused(tmp_path):
    from raytpu.driver.launch import settings_from

    config = tmp_path / "launch.yaml"
    config.write_text("scaling: {num_workers: 4, runtime: cpu}\nrun: {name: mine}\n")
    args = cli.build_parser().parse_args(["launch", "--config", str(config), "--num_processes", "2", EXAMPLE, "-x"])
    settings = settings_from(args)
    assert (settings.scaling.num_workers, settings.scaling.runtime, settings.run.name) == (2, "cpu", "mine")
    assert settings.script_args == ("-x",)
    config.write_text("loop: {epochs: 3}\n")
    with pytest.raises(ValueError, match="reads the scaling, run and checkpoint sections"):
        settings_from(args)


def test_a_tpu_slice_launches_one_process_per_chip():
    from raytpu.driver.launch import settings_from
    from raytpu.driver.ray_trainer import scaling_kwargs

    argv = ["launch", "--tpu-accelerator-type", "TPU-V5LITEPOD", "--tpu-topology", "2x4", "--runtime", "xla"]
    args = cli.build_parser().parse_args([*argv, "--num_processes", "8", EXAMPLE])
    settings = settings_from(args)
    kwargs = scaling_kwargs(settings.config)
    assert settings.scaling.tpu.layout == "multiprocess"
    assert kwargs["num_workers"] == 8 and kwargs["use_tpu"] and kwargs["resources_per_worker"]["TPU"] == 1


#: (tpu worker id, host) of world ranks 0-7 as Ray reserves them: a host's workers together, the
#: v4-16's hosts in reservation order (worker 1 first), not by worker id
V5E_8 = [(0, "10.0.0.1")] * 8
V4_16 = [(1, "10.0.0.2")] * 4 + [(0, "10.0.0.1")] * 4


@pytest.mark.parametrize(
    "accelerator_type, topology, placements", [("TPU-V5LITEPOD", "2x4", V5E_8), ("TPU-V4", "2x2x2", V4_16)]
)
def test_each_launched_process_drives_one_chip_of_the_slice(accelerator_type, topology, placements):
    """v5e-8 (one host, 8 chips) and v4-16 (two hosts of 4 chips, reserved by Ray in the other
    order): every launched process gets torch_xla's per-chip environment, a distinct task id
    for every chip of the slice, and bf16 from ``--mixed_precision auto``; nothing that would
    keep Accelerate off XLA (the driver's own USE_TORCH_XLA=0 is overridden). Without the flag the
    script's own Accelerator decides, as under ``accelerate launch``."""
    from raytpu.config.plan import ACCELERATE_NAMES, ScriptPlan
    from raytpu.config.training_args import ACCELERATE_PRECISIONS
    from raytpu.driver.launch import settings_from
    from raytpu.runtime.kinds import kind_of, resolve_precision
    from raytpu.runtime.tpu import chip_process_env, slice_spec
    from raytpu.worker.script import process_environment

    argv = ["launch", "--tpu-accelerator-type", accelerator_type, "--tpu-topology", topology, "--runtime", "xla"]
    argv += ["--mixed_precision", "auto"]
    settings = settings_from(cli.build_parser().parse_args([*argv, "--num_processes", "8", EXAMPLE]))
    spec = slice_spec(accelerator_type, topology)
    precision, _ = resolve_precision("xla", ACCELERATE_PRECISIONS[settings.mixed_precision])
    script = ScriptPlan(path=EXAMPLE, state="s", mixed_precision=ACCELERATE_NAMES[precision])
    launched = process_environment(script, kind_of("xla"))
    envs = [{**chip_process_env(rank, placements, spec), **launched} for rank in range(8)]
    assert sorted(int(env["CLOUD_TPU_TASK_ID"]) for env in envs) == list(range(8))
    assert {env["PJRT_DEVICE"] for env in envs} == {"TPU"}
    assert {env["ACCELERATE_MIXED_PRECISION"] for env in envs} == {"bf16"}
    assert all(env["USE_TORCH_XLA"] == "1" and "ACCELERATE_USE_CPU" not in env for env in envs)
    assert {env["TPU_VISIBLE_CHIPS"] for env in envs} == {str(chip) for chip in range(spec.chips_per_host)}
    assert len({env["TPU_PROCESS_ADDRESSES"] for env in envs}) == 1
    assert "ACCELERATE_MIXED_PRECISION" not in process_environment(ScriptPlan(path=EXAMPLE, state="s"), kind_of("cuda"))


def test_ray_train_s_resource_request_timeout_is_one_warning_line_on_the_console():
    """On a busy machine Ray Train's controller timed out asking the autoscaling coordinator and
    logged the timeout's traceback, which the console test then saw: the job's processes keep
    the warning and drop the traceback."""
    from raytpu.cluster.connect import AUTOSCALING_CLIENT, quiet_train_controller

    logger = logging.getLogger(AUTOSCALING_CLIENT)
    shown = io.StringIO()
    handler = logging.StreamHandler(shown)
    logger.addHandler(handler)
    filters = list(logger.filters)
    try:
        quiet_train_controller()
        try:
            raise TimeoutError("Get timed out: some object(s) not ready.")
        except TimeoutError:
            logger.warning("Failed to send resource request for train-1.", exc_info=True)
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = filters
    assert shown.getvalue() == "Failed to send resource request for train-1.\n"


def test_metrics_logged_between_polls_become_one_report_and_polled_entries_never_change():
    """Every worker reports the same entries (each report is a barrier), however its polls fall:
    rank 0's polls freeze them, another rank's see only what rank 0 froze."""
    from raytpu.records.relay import LaunchState

    state = LaunchState()
    for step in range(3):
        state.publish("metrics", {"loss": float(step), f"m{step}": 1.0})
    early, last = state.poll(0, 2, rank=1)  # rank 1 before rank 0 read anything: nothing yet
    assert early == [] and not last
    first, _ = state.poll(0, 2, rank=0)
    state.publish("metrics", {"loss": 9.0})
    state.publish("checkpoint", "/state_1")
    state.publish("metrics", {"loss": 10.0})
    between, _ = state.poll(0, 2, rank=1)  # rank 1's poll freezes nothing: the next metrics still merge
    state.publish("metrics", {"acc": 0.5})
    state.finish(0)
    state.finish(1)
    _, last = state.poll(1, 2, rank=1)
    assert not last  # rank 0 has not read the end yet
    later, last = state.poll(1, 2, rank=0)
    assert last and first == between == [("metrics", {"loss": 2.0, "m0": 1.0, "m1": 1.0, "m2": 1.0})]
    checkpoint = ("checkpoint", ("/state_1", "state_000001"))
    assert later == [("metrics", {"loss": 9.0}), checkpoint, ("metrics", {"loss": 10.0, "acc": 0.5})]
    assert state.poll(1, 2, rank=1) == (later, True)


def test_checkpoints_published_in_a_rerun_are_numbered_after_the_run_s_own():
    """A rerun of the same --name numbers its checkpoints after the highest one of the run (its
    folder, or Ray's list of it): a name taken twice would let retention delete the old one."""
    from raytpu.records.relay import LaunchState, last_state_number

    names = ["logs", "state_000002", "state_000007", "checkpoint_manager_snapshot.json", "state_x"]
    assert last_state_number(names) == 7 and last_state_number(["logs"]) == 0
    state = LaunchState(last_checkpoint=7)
    state.publish("checkpoint", "/out/a")
    state.publish("metrics", {"loss": 1.0})
    state.publish("checkpoint", "/out/b")
    entries, _ = state.poll(0, 1, rank=0)
    assert [value for kind, value in entries if kind == "checkpoint"] == [
        ("/out/a", "state_000008"),
        ("/out/b", "state_000009"),
    ]


# ------------------------------------------------------------------ on Ray
def test_a_launch_that_cannot_fit_or_would_resume_a_sharded_run_is_one_line(ray_session, tmp_path, capsys):
    """Prepared as train is: more processes than the cluster has or can start, and a launch named
    after a sharded train run (its newest checkpoint sharded), are one line each, before any worker."""
    sharded = tmp_path / "runs" / "sharded-run" / "checkpoint_00000004"
    sharded.mkdir(parents=True)
    (sharded / "meta.json").write_text(json.dumps({"step": 4, "sharded": True}))
    for name, argv, message in (
        ("big", ["--num_processes", "64"], "2 worker(s) fit: set --num_processes 2"),
        ("sharded-run", [], "checkpoint_00000004 was written by a sharded raytpu train run"),
    ):
        assert launch(tmp_path, name, *argv, EXAMPLE) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("raytpu: error: ") and "\n" not in err and message in err, err


@pytest.mark.integration
@pytest.mark.parametrize("script", ["test_script.py", "test_sync.py"])
def test_accelerate_s_own_distributed_tests_pass_on_two_ray_workers(ray_session, tmp_path, script):
    """Accelerate's test scripts, as ``accelerate test`` runs them, with no environment set by the
    user: really distributed over the gloo group (MULTI_CPU, 2 processes), not one process each."""
    code = launch(tmp_path, script, "--num_processes", "2", str(ACCELERATE_SCRIPTS / script))
    log = log_of(tmp_path, script)
    assert code == 0, log[-3000:]
    if script == "test_script.py":
        assert "Distributed environment: DistributedType.MULTI_CPU" in log and "Num processes: 2" in log, log[:2000]
    else:
        assert "**Test Distributed `no_sync` context manager**" in log, log[-2000:]
    assert "Process index: 1" in log_of(tmp_path, script, 1) or script == "test_sync.py"


@pytest.mark.integration
def test_the_example_on_two_workers_equals_one_process_and_its_states_are_ray_checkpoints(ray_session, tmp_path):
    common = ["--epochs", "2", "--global-batch-size", "32"]
    single = subprocess.run(
        [sys.executable, EXAMPLE, *common, "--results-dir", str(tmp_path / "single")],
        env={**os.environ, "USE_TORCH_XLA": "0", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    keep = tmp_path / "keep.yaml"  # every state kept, to see each one's name
    keep.write_text("checkpoint: {num_to_keep: 10}\n")
    argv = ["--config", str(keep), "--num_processes", "2", "--profile", "3:4", EXAMPLE, *common]
    code = launch(tmp_path, "example", *argv, "--results-dir", str(tmp_path / "two"))
    logs = [log_of(tmp_path, "example", rank) for rank in (0, 1)]
    assert code == 0, logs[0][-3000:]
    assert "DistributedType.MULTI_CPU, 2 process(es)" in logs[0]
    assert "process 0 of 2" in logs[0] and "process 1 of 2" in logs[1]
    summary = json.loads(logs[0].strip().splitlines()[-1])
    assert summary["processes"] == 2 and summary["steps"] == 64
    one, two = final_weights(tmp_path / "single"), final_weights(tmp_path / "two")
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5)
    run_dir = tmp_path / "runs" / "example"
    first = states_of(run_dir)
    assert first == [f"state_{n:06d}" for n in (1, 2, 3, 4)], first  # 64 steps, a state every 16
    assert all((run_dir / name / "model.safetensors").is_file() for name in first)
    saved = tmp_path / "two" / "state_000016" / "model.safetensors"  # the script's own first save_state
    assert os.path.samefile(run_dir / "state_000001" / "model.safetensors", saved)  # stored once: a hard link
    assert snapshot_names(run_dir) == first
    record = json.loads((run_dir / "goodput.json").read_text())  # the launch's time, as a train's
    (command,) = record["commands"]
    assert command["outcome"] == "completed" and len(command["attempts"]) == 1
    assert set(command["marks"]) == {"connect", "connected", "fit", "fitted"}
    assert sum(record["categories"].values()) == pytest.approx(record["wall_s"])
    assert record["categories"]["productive"] > 0 and record["categories"]["startup"] > 0
    marks, names = traced_steps(run_dir / "profile" / "rank_0.pt.trace.json")  # --profile 3:4, rank 0 only
    assert marks == {"raytpu step 3", "raytpu step 4"} and "aten::addmm" in names
    assert [p.name for p in (run_dir / "profile").iterdir()] == ["rank_0.pt.trace.json"]

    # the same --name again, one epoch further: it resumes from the newest state, and its states
    # are numbered after the first run's, which are all still there
    more = ["--epochs", "3", "--global-batch-size", "32", "--results-dir", str(tmp_path / "two")]
    code = launch(tmp_path, "example", "--config", str(keep), "--num_processes", "2", EXAMPLE, *more)
    log = log_of(tmp_path, "example")
    assert code == 0, log[-3000:]
    assert "resumed at step 64" in log, log[-2000:]
    assert states_of(run_dir) == snapshot_names(run_dir) == [f"state_{n:06d}" for n in range(1, 7)]


def states_of(run_dir: Path) -> list[str]:
    return sorted(path.name for path in run_dir.iterdir() if path.name.startswith("state_"))


def snapshot_names(run_dir: Path) -> list[str]:
    """The checkpoints Ray Train's list of the run names (what it resumes from and prunes)."""
    snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    return sorted(result["checkpoint_dir_name"] for result in snapshot["checkpoint_results"])


@pytest.mark.integration
def test_a_killed_process_restarts_from_the_last_saved_state_in_a_bucket(ray_session, tmp_path):
    """The run folder in S3: the save_state checkpoints and both processes' logs are stored there,
    and a process killed mid-run restarts from the last saved state, read back from the bucket."""
    from raytpu.storage.run_folder import RunFolder
    from tests.stores import BUCKET

    storage = f"s3://{BUCKET}/launch-{tmp_path.name}"
    run_dir = RunFolder(f"{storage}/killed")

    def kill_a_worker() -> None:
        deadline = time.monotonic() + 600  # a guard against a hang only
        # two reported states: the first one's report (a barrier of all workers) is complete
        while len([n for n in run_dir.children() if n.startswith("state_")]) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        staged = (run_dir.local("logs") / "rank_1.log").read_text()  # the process's log as it is written
        line = next(line for line in staged.splitlines() if line.startswith("process 1 of 2"))
        os.kill(int(line.split("(pid ")[1].rstrip(")")), signal.SIGKILL)

    killer = threading.Thread(target=kill_a_worker, daemon=True)
    killer.start()
    # 512 samples / 32 a step = 16 steps an epoch, 32 in all, a state every 4: the kill comes at
    # step 8 or soon after, with at least 6 s (24 steps of 0.25 s) of the run still to go
    argv = ["--num_processes", "2", "--max-failures", "1", EXAMPLE, "--epochs", "2", "--step-sleep", "0.25"]
    argv += ["--samples", "512", "--ckpt-every", "4", "--results-dir", str(tmp_path / "out")]
    code = cli.main(["launch", "--storage-path", storage, "--name", "killed", *argv])
    killer.join()
    log = run_dir.read_text("logs/rank_0.log") or ""
    assert code == 0, log[-3000:]
    assert "resumed at step" in log and '"steps": 32' in log, log[-2000:]
    assert "process 1 of 2" in (run_dir.read_text("logs/rank_1.log") or "")
    states = [n for n in run_dir.children() if n.startswith("state_")]
    assert states and run_dir.exists(f"{states[-1]}/model.safetensors"), run_dir.children()


@pytest.mark.integration
def test_a_raising_script_is_its_traceback_then_one_line(ray_session, tmp_path, capfd):
    raising = tmp_path / "raising.py"
    raising.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('bad batch 7')\n")
    capfd.readouterr()  # one restart allowed: the failed attempt and its rerun show one traceback
    assert launch(tmp_path, "raising", "--num_processes", "2", "--max-failures", "1", str(raising)) == 1
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert lines[-1] == "raytpu: error: rank 1: ValueError: bad batch 7", lines[-8:]
    shown = out + err  # the script's traceback once, its own frames only, and nothing of Ray Train's
    assert shown.count("Traceback (most recent call last)") == 1 and f'File "{raising}", line 3' in shown, shown
    assert not [mark for mark in ("Error in training function", "raytpu/", "ray/train") if mark in shown], shown


CONSOLE_SCRIPT = """
import logging, os, sys, time
from tqdm import tqdm

logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
                    handlers=[logging.StreamHandler(sys.stdout)])
logger = logging.getLogger(__name__)
logger.setLevel(logging.INFO)
logger.warning("Process rank: %s, world size: %s", os.environ["RANK"], os.environ["WORLD_SIZE"])
here = os.path.dirname(os.path.abspath(__file__))
started, done = os.path.join(here, "rank_1.started"), os.path.join(here, "rank_0.done")
if os.environ["RANK"] == "1":
    open(started, "w").close()
logger.info("training starts")
logging.getLogger("elsewhere").info("below the root level")
for _ in tqdm(range(40), desc="steps", mininterval=0):
    time.sleep(0.01)
# the first rank to exit ends the run: rank 0 waits for rank 1's first line (a busy machine may
# start rank 1 late), then rank 1 waits for rank 0's lines to go first
if os.environ["RANK"] == "0":
    while not os.path.exists(started):
        time.sleep(0.05)
    sys.stdout.flush()
    open(done, "w").close()
else:
    while not os.path.exists(done):
        time.sleep(0.05)
sys.exit(3)
"""


@pytest.mark.integration
def test_the_console_is_the_script_s_own_on_a_terminal_beside_another_ray_instance(ray_session, tmp_path):
    """Under a pseudo-terminal, with the test session's Ray instance running beside the one the
    command starts: rank 0's logging in the script's own format and stream, its progress bar
    redrawn in place (``\\r``), rank 1's lines in its log file, nothing of Ray, and the script's
    ``sys.exit(3)`` the command's status."""
    import pty

    script = tmp_path / "console.py"
    script.write_text(CONSOLE_SCRIPT)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    command = [str(Path(sys.executable).with_name("raytpu")), "launch", "--num_processes", "2"]
    command += ["--storage-path", str(tmp_path / "runs"), "--name", "console", str(script)]
    controller, terminal = pty.openpty()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdin=terminal, stdout=terminal, stderr=terminal)
    os.close(terminal)
    shown = read_terminal(controller)
    assert process.wait(timeout=300) == 3, shown[-3000:]
    text = shown.decode(errors="replace")
    line = r"\d\d/\d\d/\d{4} \d\d:\d\d:\d\d - WARNING - __main__ - Process rank: 0, world size: 2"
    assert re.search(line, text) and " - INFO - __main__ - training starts" in text, text[-3000:]
    assert "below the root level" not in text and "Process rank: 1" not in text
    assert len(re.findall(rb"\r(?!\n)", shown)) >= 20, shown[-2000:]  # redrawn, not a line per refresh
    assert len([line for line in text.split("\n") if "steps:" in line]) == 1, text[-3000:]  # one line, redrawn
    leaked = [mark for mark in ("Traceback", "multiple active Ray instances", "RayTrainWorker pid") if mark in text]
    assert not leaked, text[-3000:]
    assert re.search(line.replace("rank: 0", "rank: 1"), log_of(tmp_path, "console", 1))


def read_terminal(controller: int) -> bytes:
    """Everything written to a pseudo-terminal until its last writer closes it."""
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: every process holding the terminal has ended
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    return b"".join(chunks)


@pytest.mark.integration
def test_the_example_on_the_xla_cpu_device_computes_in_bf16(ray_session, tmp_path):
    """One worker on the XLA runtime (the CPU PJRT device): an fp16 request becomes bf16 (the flag,
    and the script's own Accelerator(mixed_precision="fp16")), each seen in the dtype the forward
    pass computes in (``--mixed_precision auto``, bf16 the same way: the launch plan's environment,
    ``test_each_launched_process_drives_one_chip_of_the_slice``)."""
    argv = ["--runtime", "xla", "--mixed_precision", "fp16", "--profile", "2:3", EXAMPLE, "--epochs", "1"]
    assert launch(tmp_path, "xla-fp16", *argv, "--samples", "256", "--results-dir", str(tmp_path / "a")) == 0
    log = log_of(tmp_path, "xla-fp16")
    assert "DistributedType.XLA, 1 process(es)" in log and "forward dtype torch.bfloat16" in log, log[-2000:]
    traces = [p.name.split(".", 1)[1] for p in (tmp_path / "runs" / "xla-fp16" / "profile").rglob("*.*")]
    assert sorted(traces) == ["trace.json.gz", "xplane.pb"], traces  # torch_xla's profiler, on the CPU device
    own = tmp_path / "own_fp16.py"
    own.write_text(
        "import torch\nfrom accelerate import Accelerator\n"
        "accelerator = Accelerator(mixed_precision='fp16')\n"
        "model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 2)))\n"
        "seen = []\n"
        "accelerator.unwrap_model(model)[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype) or None)\n"
        "with accelerator.autocast():\n"
        "    model(torch.ones(3, 4, device=accelerator.device))\n"
        "print('forward dtype', seen[0])\n"
    )
    assert launch(tmp_path, "xla-own", "--runtime", "xla", str(own)) == 0
    log = log_of(tmp_path, "xla-own")
    assert "forward dtype torch.bfloat16" in log and "using bf16 instead" in log, log[-2000:]
