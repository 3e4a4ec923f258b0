"""Clusters as users have them: accelerator nodes that an autoscaler starts on demand. One cluster,
``tests/autoscaling_cluster.py`` in a PID namespace of its own (Ray's autoscaler with the fake
multi-node provider and ``cluster.yaml``'s node types, TPU and GPU, its head started by
``cluster.yaml``'s own start commands with token authentication), serves every test here: the
runtime ``auto`` picks from the node types, the TPU or GPU each worker asks for, the node the
autoscaler starts for them (and releases after), the run in the S3 bucket, and the one-line errors
of a request no node type can satisfy, of a wait that runs out and of a client without the
cluster's token."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from raytpu.storage.run_folder import RunFolder, local_copy
from tests.conftest import in_own_pid_namespace
from tests.stores import BUCKET, S3_KEYS

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
RUNS = f"s3://{BUCKET}/autoscaling"


@pytest.fixture(scope="module")
def report(stores) -> dict[str, Any]:
    """What the cluster's scenario saw (``tests.autoscaling_cluster``, in a PID namespace)."""
    out = tempfile.mkdtemp(prefix="rtas-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {"RAYTPU_AUTOSCALING_RUNS": RUNS}
    try:
        done = subprocess.run(
            in_own_pid_namespace([sys.executable, "-m", "tests.autoscaling_cluster", out]),
            cwd=ROOT,
            # PJRT_DEVICE=CPU (the XLA tests' in this process) would opt the cluster's xla runs into the CPU
            env={**{k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}, "PYTHONPATH": str(ROOT), **env},
            capture_output=True,
            text=True,
            timeout=1200,
        )
        reports = [line for line in done.stdout.splitlines() if line.startswith("{")]
        assert done.returncode == 0 and reports, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads(reports[-1])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def error_line(result: dict[str, Any]) -> str:
    """The command's one ``raytpu: error:`` line (and no traceback of its own)."""
    errors = [line for line in result["err"].splitlines() if line.startswith("raytpu: error:")]
    assert len(errors) == 1 and "Traceback" not in result["err"], result["err"][-3000:]
    return errors[0]


def launched(types: list[str]) -> list[str]:
    return [name for name in types if not name.startswith("node_")]  # the head's is its id


def test_a_client_without_the_token_and_a_request_no_node_type_can_satisfy_are_one_line(report) -> None:
    assert report["start_commands"][0] == "ray stop"
    assert "RAY_AUTH_MODE=token ray start --head" in report["start_commands"][1]
    no_token = report["no_token_mode"]
    line = error_line(no_token)
    assert no_token["code"] == 2
    assert "uses token authentication and this client sends no token: export RAY_AUTH_MODE=token" in line
    impossible = report["impossible"]
    line = error_line(impossible)
    assert impossible["code"] == 2
    assert "1 cuda worker(s) needs 1 CPU, 8 GPU" in line and "no node has 8 GPU" in line
    for node_type in ("tpu_v5e_8 (2 CPU, 8 TPU; at most 1)", "tpu_v5e_16_slice (2 CPU, 4 TPU; at most 4)"):
        assert node_type in line
    assert "gpu_t4 (2 CPU, 1 GPU; at most 2)" in line
    assert not [name for name in report["types_before_submit"] if not name.startswith("node_")]


def test_a_run_submitted_to_a_cluster_from_cluster_yaml_starts_its_tpu_node(report) -> None:
    submit = report["submit"]
    assert submit["code"] == 0, submit["out"][-3000:] + submit["err"][-3000:]
    out = submit["out"]
    assert "raytpu: scaling.runtime auto -> xla: the autoscaler can start TPU nodes: tpu_v5e_8 (8 TPU)" in out
    assert "1 xla worker(s) (1 CPU, 8 TPU each) wait for the autoscaler to start nodes" in out
    assert f"best checkpoint:   {RUNS}/on-demand/checkpoint_" in out and "succeeded" in out.splitlines()[-1]
    assert launched(report["types_launched"]) == ["tpu_v5e_8"]
    assert report["workers"] and {w["node_type"] for w in report["workers"]} == {"tpu_v5e_8"}, report["workers"]
    assert report["tpu_released_after_s"] is not None

    torch_tpu = report["torch_tpu"]  # planned and placed as TorchTPU's, refused by the fake node that lacks it
    assert "1 torch_tpu worker(s), bf16, torch.compile (default), 4 samples per worker" in torch_tpu["out"], torch_tpu
    assert torch_tpu["code"] == 1 and "this worker has no torch_tpu" in error_line(torch_tpu), torch_tpu["err"][-3000:]
    placed = report["torch_tpu_workers"]  # on a TPU node the autoscaler has or starts, a chip each
    assert len(placed) == 1 and placed[0]["node_type"].startswith("tpu_v5e"), placed

    run = RunFolder(f"{RUNS}/on-demand")
    assert [n for n in run.children() if n.startswith("checkpoint_0") and run.exists(f"{n}/meta.json")]
    seen = {"runtime_env": json.dumps(report["runtime_env"]), "job logs": out + submit["err"]}
    seen["config.yaml"] = run.read_text("config.yaml") or ""
    with local_copy(run.uri("tensorboard")) as events:
        seen["tensorboard"] = "".join(p.read_bytes().decode("latin-1") for p in events.iterdir())
    for secret in S3_KEYS.values():  # each node reads its own keys; none travels with the job
        assert not [where for where, text in seen.items() if secret in text], secret


def test_a_cuda_run_starts_the_gpu_node_and_a_wait_gives_up_after_its_limit(report) -> None:
    cuda = report["cuda"]
    assert "1 cuda worker(s) (1 CPU, 1 GPU each) wait for the autoscaler to start nodes" in cuda["out"]
    assert cuda["code"] == 1 and "GPU" in error_line(cuda)  # the fake GPU node has no CUDA device
    assert launched(report["types_launched_for_cuda"]) == ["gpu_t4"] and report["gpu_released_after_s"] is not None

    gives_up = report["gives_up"]
    line = error_line(gives_up)
    assert gives_up["code"] == 1
    assert "waiting for the autoscaler to start nodes for 1 cuda worker(s) (1 CPU, 1 GPU each;" in line
    assert "raise scaling.node_start_timeout_s" in line


def test_doctor_reads_the_node_types_on_the_head(report) -> None:
    doctor = json.loads(report["doctor"]["out"])  # the dashboard's address, as the walk-through gives it
    assert doctor["cluster"]["reachable"] and doctor["cluster"]["auto_runtime"] == "xla", doctor["cluster"]
    names = [node_type["name"] for node_type in doctor["cluster"]["node_types"]]
    assert names == ["tpu_v5e_8", "tpu_v5e_16_slice", "gpu_t4"], names


def test_an_autoscaler_event_read_in_halves_leaves_no_traceback_on_the_driver() -> None:
    """Ray's log monitor can read a line of the autoscaler's event file while it is being written;
    the driver then parses two halves. After raytpu's connect they are dropped, whole events still
    parse, and the logger's other errors still reach its handlers."""
    import logging

    from ray._private.event.event_logger import global_logger, parse_event
    from ray.core.generated.event_pb2 import Event

    from raytpu.cluster.connect import quiet_ray

    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    global_logger.addHandler(handler)
    try:
        quiet_ray()
        event = Event(message="Adding 1 node(s) of type tpu_v5e_8.", severity=Event.Severity.INFO)
        whole = json.dumps({"message": event.message, "severity": "INFO"})
        assert parse_event(whole[:40]) is None and parse_event(whole[40:]) is None and seen == []
        assert parse_event(whole).message == event.message
        global_logger.error("Failed to flush event logger handler.")
        assert [record.getMessage() for record in seen] == ["Failed to flush event logger handler."]
    finally:
        global_logger.removeHandler(handler)
