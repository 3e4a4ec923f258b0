"""raytpu doctor: the report on this machine, the version and lock checks as pure functions, the exit code."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raytpu.cluster import connect, probe
from raytpu.driver import doctor
from tests.conftest import run_python

REPORT_KEYS = {"versions", "torch_xla_match", "devices", "auto", "conflicts", "cluster", "problems", "blocking"}


@pytest.fixture(autouse=True)
def no_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections and never answers (a Ray client would wait forever)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_json_report_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == REPORT_KEYS
    versions = report["versions"]
    assert versions["python"] == platform.python_version()
    assert versions["torch"] == importlib.metadata.version("torch")
    assert versions["ray"] == importlib.metadata.version("ray")
    assert report["torch_xla_match"]["ok"] is True
    assert set(report["devices"]) == {"tpu", "cuda", "cpu"}
    assert report["devices"]["cpu"]["count"] >= 1
    assert isinstance(report["devices"]["tpu"]["chips"], int)
    assert report["auto"]["runtime"] in ("cpu", "cuda", "xla")
    assert report["auto"]["precision"] == {"cpu": "fp32", "cuda": "bf16", "xla": "bf16"}[report["auto"]["runtime"]]
    assert report["cluster"] == {"address": None, "reachable": None, "message": probe.NO_CLUSTER, "nodes": []}
    assert report["blocking"] is False
    assert not [p for p in report["problems"] if p["blocking"]]


def test_table_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert f"cluster    {probe.NO_CLUSTER}" in out
    assert out.rstrip().endswith("result     ok")
    for name in ("python", "torch", "torch_xla", "ray", "tpu", "cuda", "cpu", "auto"):
        assert any(line.startswith(f"{name} ") for line in out.splitlines()), name


def test_report_never_imports_torch_xla() -> None:
    code = "import sys; from raytpu.driver import doctor; doctor.collect_report(); print('torch_xla' in sys.modules)"
    done = run_python(["-c", code], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize(
    ("torch_version", "xla_version", "ok", "blocking"),
    [
        ("2.9.0", "2.9.0", True, False),
        ("2.9.0+cu128", "2.9.0", True, False),
        ("2.9.0+cpu", "2.9.0+libtpu", True, False),
        ("2.9", "2.9.0", True, False),
        ("2.9.0.dev20250801+cpu", "2.9.0.dev20250801", True, False),
        ("2.14.1", "2.9.0", False, True),
        ("2.9.1", "2.9.0", False, True),
        ("2.8.0", "2.9.0", False, True),
        ("2.9.0", None, True, False),
        (None, "2.9.0", False, True),
        (None, None, False, True),
    ],
)
def test_torch_xla_match(torch_version: str | None, xla_version: str | None, ok: bool, blocking: bool) -> None:
    result = doctor.check_torch_xla_match(torch_version, xla_version)
    assert (result["ok"], result["blocking"]) == (ok, blocking)
    assert result["message"]


def test_torch_xla_mismatch_says_how_to_fix() -> None:
    message = doctor.check_torch_xla_match("2.14.1", "2.9.0")["message"]
    assert "torch 2.14.1 does not match torch_xla 2.9.0" in message
    assert "'torch==2.9.0'" in message


def test_torchvision_and_tensorflow_warnings() -> None:
    assert doctor.check_torchvision("2.9.0+cu128", "0.24.0") is None
    assert doctor.check_torchvision("2.9.0", None) is None
    warning = doctor.check_torchvision("2.9.0", "0.26.0")
    assert warning is not None and not warning["blocking"] and "torchvision==0.24.0" in warning["message"]
    assert doctor.check_tensorflow("2.18.0", None) is None
    assert doctor.check_tensorflow(None, "2.9.0") is None
    warning = doctor.check_tensorflow("2.18.0", "2.9.0")
    assert warning is not None and not warning["blocking"] and "tensorflow 2.18.0" in warning["message"]


def test_exit_code() -> None:
    warning = doctor.problem("tensorflow", "careful", blocking=False)
    blocking = doctor.problem("libtpu_lock", "held", blocking=True)
    assert doctor.exit_code([]) == 0
    assert doctor.exit_code([warning]) == 0
    assert doctor.exit_code([warning, blocking]) == 1


def test_blocking_problems() -> None:
    match_ok = doctor.check_torch_xla_match("2.9.0", "2.9.0")
    mismatch = doctor.check_torch_xla_match("2.14.1", "2.9.0")
    no_cluster = probe.check_cluster(None)
    unreachable = {"address": "h:6379", "reachable": False, "message": "cannot reach h:6379", "nodes": []}
    warning = doctor.problem("tensorflow", "careful", blocking=False)
    assert doctor.gather_problems(match_ok, [warning], no_cluster) == [warning]
    assert doctor.exit_code(doctor.gather_problems(match_ok, [warning], no_cluster)) == 0
    assert [p["check"] for p in doctor.gather_problems(mismatch, [], no_cluster)] == ["torch_xla_match"]
    assert doctor.exit_code(doctor.gather_problems(mismatch, [], no_cluster)) == 1
    assert doctor.exit_code(doctor.gather_problems(match_ok, [], unreachable)) == 1


def test_libtpu_lock() -> None:
    assert doctor.check_libtpu_lock(False, []) is None
    stale = doctor.check_libtpu_lock(True, [])
    assert stale is not None and not stale["blocking"] and "rm /tmp/libtpu_lockfile" in stale["message"]
    held = doctor.check_libtpu_lock(True, [{"pid": 42, "command": "python train.py"}])
    assert held is not None and held["blocking"] and "pid 42 (python train.py)" in held["message"]


def test_lock_holder_is_found(tmp_path: Path) -> None:
    lockfile = tmp_path / "libtpu_lockfile"
    lockfile.touch()
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(lockfile)!r}); import time; time.sleep(60)"])
    try:
        for _ in range(100):
            holders = doctor.tpu_holders(str(lockfile))
            if holders:
                break
            time.sleep(0.1)
        assert holder.pid in [h["pid"] for h in holders]
        conflicts = doctor.collect_conflicts({"torch": "2.9.0"}, str(lockfile))
        assert [(c["check"], c["blocking"]) for c in conflicts] == [("libtpu_lock", True)]
    finally:
        holder.kill()
        holder.wait()
    stale = doctor.collect_conflicts({}, str(lockfile))
    assert [(c["check"], c["blocking"]) for c in stale] == [("libtpu_lock", False)]


def test_auto_choice() -> None:
    xla = doctor.auto_choice(4, True, {"available": False})
    assert (xla["runtime"], xla["precision"], xla["note"]) == ("xla", "bf16", "TPUs compute in bf16")
    cuda = doctor.auto_choice(0, True, {"available": True, "bf16": True})
    assert (cuda["runtime"], cuda["precision"]) == ("cuda", "bf16") and "since Ampere" in cuda["note"]
    old_gpu = doctor.auto_choice(0, True, {"available": True, "bf16": False})
    assert (old_gpu["precision"], old_gpu["note"]) == (
        "fp16",
        "this GPU has no bf16: fp16 autocast with a gradient scaler",
    )
    assert doctor.auto_choice(0, False, {"available": False}) == {"runtime": "cpu", "precision": "fp32"}
    no_xla = doctor.auto_choice(8, False, {"available": False})
    assert (no_xla["runtime"], no_xla["precision"]) == ("cpu", "fp32")
    assert "torch_xla is not installed" in no_xla["note"]


def test_tpu_slice_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-16")
    tpu = doctor.tpu_devices()
    assert tpu["env"]["TPU_ACCELERATOR_TYPE"] == "v5litepod-16"
    assert tpu["slice"]["num_hosts"] == 4 and tpu["slice"]["chips_per_host"] == 4
    assert tpu["slice"]["accelerator_type"] == "TPU-V5LITEPOD"


def test_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    assert connect.resolve_address(None) is None
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert connect.resolve_address(None) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert connect.resolve_address(None) == "10.0.0.2:6379"
    assert connect.resolve_address("ray://head:10001") == "ray://head:10001"
    assert connect.host_port("10.0.0.2:6379") == ("10.0.0.2", 6379)
    assert connect.host_port("head") == ("head", 6379)
    assert connect.host_port("ray://head") == ("head", 10001)
    assert connect.host_port("http://127.0.0.1:8265") == ("127.0.0.1", 8265)
    assert connect.host_port("auto") is None


def test_named_cluster_that_refuses_is_blocking(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{closed_port()}"
    assert doctor.main(["--json", "--address", address]) == 1
    cluster = json.loads(capsys.readouterr().out)["cluster"]
    assert cluster["reachable"] is False and cluster["message"].startswith(f"cannot reach {address}")


def test_cluster_that_never_answers_times_out(silent_server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{silent_server}")
    report = doctor.collect_report(timeout=3)
    assert report["cluster"]["reachable"] is False
    assert "no answer within 3 s" in report["cluster"]["message"]
    assert report["blocking"] is True


@pytest.mark.integration
def test_reaches_a_running_cluster(ray_session) -> None:
    address = ray_session.get_runtime_context().gcs_address
    found = probe.check_cluster(address, timeout=120)
    assert found["reachable"] is True, found["message"]
    assert found["nodes"] and found["nodes"][0]["alive"] is True
    assert found["totals"]["CPU"] >= 1
    assert found["auto_runtime"] == "cpu"
