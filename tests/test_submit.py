"""raytpu submit: the pure pieces (entrypoint, runtime_env, address, token, follow-up), and
integration tests against a real local head (`ray start --head` on loopback with its own ports,
temp dir and token): the TPU cluster page's commands (`raytpu submit` and plain `ray job submit`
into a bucket), a `raytpu submit` refused without the token, and `raytpu launch` through both."""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from raytpu.config import load_config
from raytpu.driver.submit import (
    EXCLUDES,
    Shipment,
    SubmitError,
    auth_headers,
    dashboard_url,
    entrypoint,
    follow_up,
    job_packages,
    launch_entrypoint,
    runtime_env,
    shipment,
    split_args,
    submission_id,
)
from tests.stores import free_ports

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


# ------------------------------------------------------------------ pure pieces
def test_split_args_takes_the_flags_out() -> None:
    assert split_args(["optim.lr=0.1", "--address", "http://h:8265", "--no-wait", "--epochs", "2"]) == (
        "http://h:8265",
        False,
        ["optim.lr=0.1", "--epochs", "2"],
    )
    assert split_args(["--address=h:8265"]) == ("h:8265", True, [])


def test_entrypoint_is_raytpu_train_with_quoted_overrides() -> None:
    assert entrypoint("jobs/mshnet/small.yaml", ["optim.lr=0.1", "run.name=a b"]) == (
        "raytpu train jobs/mshnet/small.yaml optim.lr=0.1 'run.name=a b'"
    )


def test_runtime_env_uploads_the_project_without_data_and_outputs() -> None:
    env = runtime_env(Path("/p"))
    assert env["working_dir"] == "/p"
    for pattern in ("/data", "/results", "/.venv", "/.git", "__pycache__"):
        assert pattern in env["excludes"]
    env["excludes"].append("x")
    assert "x" not in EXCLUDES


def test_excludes_leave_jobs_and_configs_in(tmp_path: Path) -> None:
    """Ray applies the excludes as gitignore patterns: check them with its own matcher."""
    from ray._private.runtime_env.packaging import _get_excludes

    for name in ("data/mshnet/a.png", "results/run/x.pt", ".venv/bin/python", "jobs/mshnet/small.yaml", "raytpu/a.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    excluded = _get_excludes(tmp_path, EXCLUDES)
    for name in ("data", "data/mshnet/a.png", "results", "results/run/x.pt", ".venv"):
        assert excluded(tmp_path / name), name
    assert not excluded(tmp_path / "jobs") and not excluded(tmp_path / "jobs/mshnet/small.yaml")
    assert not excluded(tmp_path / "raytpu/a.py")


def test_dashboard_url() -> None:
    assert dashboard_url("http://h:8265", {}) == "http://h:8265"
    assert dashboard_url(None, {"RAY_ADDRESS": "10.0.0.2:8265"}) == "http://10.0.0.2:8265"
    with pytest.raises(SubmitError, match="needs the cluster's dashboard address"):
        dashboard_url(None, {})
    with pytest.raises(SubmitError, match="submitted to the dashboard"):
        dashboard_url("ray://h:10001", {})


def test_a_join_that_fails_without_a_token_says_where_the_token_goes(tmp_path: Path, monkeypatch) -> None:
    """Every form of address (``ray://``, ``auto``, ``HOST:PORT``) gets the token hint when this
    client would send no token, and none when it would."""
    from raytpu.cluster.connect import token_hint

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert "export RAY_AUTH_MODE=token" in token_hint()
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert "RAY_AUTH_TOKEN" in token_hint()  # token mode, but no token anywhere
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    assert token_hint() == ""


def test_auth_headers_sources_in_order(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("from-home\n")
    other = tmp_path / "token"
    other.write_text("from-path")
    bearer = {"Authorization": "Bearer from-env"}
    assert auth_headers({"RAY_AUTH_TOKEN": "from-env", "RAY_AUTH_TOKEN_PATH": str(other)}, home) == bearer
    assert auth_headers({"RAY_AUTH_TOKEN_PATH": str(other)}, home) == {"Authorization": "Bearer from-path"}
    assert auth_headers({}, home) == {"Authorization": "Bearer from-home"}
    assert auth_headers({}, tmp_path / "nobody") == {}
    assert auth_headers({"RAY_AUTH_TOKEN": "t", "RAY_AUTH_MODE": "disabled"}, home) == {}


def test_submission_id_is_readable_and_safe() -> None:
    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    assert submission_id("mshnet-small", now) == "raytpu-mshnet-small-20260102-030405"
    assert submission_id("a b/c", now) == "raytpu-a-b-c-20260102-030405"


def test_follow_up_names_logs_and_tensorboard() -> None:
    cfg, _ = load_config("jobs/mshnet/small.yaml", ["run.storage_path=/mnt/gcs/runs"])
    lines = follow_up("http://h:8265", "raytpu-x", cfg)
    assert "ray job logs --address http://h:8265 --follow raytpu-x" in lines[1]
    assert "tensorboard --logdir /mnt/gcs/runs/mshnet-small/tensorboard" in lines[4]


def project_with(tmp_path: Path, *folders: str) -> Path:
    """A project folder with the quick start's config, a .gitignore like raytpu's, and ``folders``."""
    project = tmp_path / "project"
    (project / "jobs" / "mshnet").mkdir(parents=True)
    shutil.copy(ROOT / "jobs/mshnet/small.yaml", project / "jobs/mshnet/small.yaml")
    (project / ".gitignore").write_text("/scratch/\n")
    for folder in folders:
        (project / folder).mkdir(parents=True)
        (project / folder / "trainval.txt").write_text("a\n")
    return project


def test_a_job_finds_its_config_and_data_on_the_cluster_or_is_not_submitted(tmp_path: Path, monkeypatch) -> None:
    project = project_with(tmp_path, "data/irstd", "scratch/set", "inputs/small")
    monkeypatch.chdir(project)

    def ship(config: str, *overrides: str) -> Shipment:
        cfg, _ = load_config(config, list(overrides))
        return shipment(cfg, "raytpu.jobs.mshnet", config, project)

    shipped = ship(str(project / "jobs/mshnet/small.yaml"), "run.storage_path=gs://b/runs")
    assert shipped.config == "jobs/mshnet/small.yaml" and shipped.py_modules == ()
    assert "the job synthesizes a small set there" in shipped.notes[0]  # data/mshnet: made on the cluster
    relative = ship("jobs/mshnet/small.yaml")
    assert "run.storage_path './results' is relative" in relative.notes[0]
    assert "travels with the job" in ship("jobs/mshnet/small.yaml", "data.path=inputs/small").notes[1]
    assert ship("jobs/mshnet/small.yaml", "data.path=/mnt/data", "run.storage_path=/mnt/runs").notes == ()
    assert ship("jobs/mshnet/small.yaml", "data.path=s3://b/d", "run.storage_path=s3://b/r").notes == ()
    for only_here in ("data/irstd", "scratch/set"):  # excluded by raytpu, by the project's .gitignore
        for synthesize in ("false", "true"):  # the user's data is never replaced by a synthetic set there
            with pytest.raises(SubmitError, match=f"data.path '{only_here}' is on this machine only.*data prepare"):
                ship("jobs/mshnet/small.yaml", f"data.path={only_here}", f"data.synthesize_if_missing={synthesize}")
    with pytest.raises(SubmitError, match="data.path 'nowhere' exists neither here nor"):
        ship("jobs/mshnet/small.yaml", "data.path=nowhere", "data.synthesize_if_missing=false")
    outside = tmp_path / "elsewhere.yaml"
    shutil.copy(ROOT / "jobs/mshnet/small.yaml", outside)
    with pytest.raises(SubmitError, match="the config .*elsewhere.yaml is not in what raytpu submit uploads"):
        ship(str(outside))


def test_a_job_module_outside_the_project_travels_as_a_package(tmp_path: Path, monkeypatch) -> None:
    project = project_with(tmp_path)
    package = tmp_path / "mylab" / "myjobs"
    package.mkdir(parents=True)
    (tmp_path / "mylab" / "myjobs" / "__init__.py").write_text("")
    (package / "segment.py").write_text("")
    (tmp_path / "lonely_job.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "mylab"))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert job_packages("myjobs.segment", project) == [str(package)]
    assert job_packages("raytpu.jobs.mshnet", project) == []
    with pytest.raises(SubmitError, match="job module lonely_job is a single file outside"):
        job_packages("lonely_job", project)
    assert runtime_env(project, (str(package),))["py_modules"] == [str(package)]


def test_submit_checks_paths_before_it_connects(tmp_path: Path, monkeypatch, capsys) -> None:
    from raytpu import cli

    project = project_with(tmp_path, "data/irstd")
    monkeypatch.chdir(project)
    argv = ["submit", "jobs/mshnet/small.yaml", "data.path=data/irstd", "data.synthesize_if_missing=false"]
    assert cli.main([*argv, "--address", "http://127.0.0.1:1"]) == 2  # nothing listens there: never reached
    assert "data.path 'data/irstd' is on this machine only" in capsys.readouterr().err


#: a data path on the cluster's nodes, which raytpu submit does not look for here
NODES_DATA = "data.path=/mnt/raytpu-data"


def raytpu(*args: str, env: dict[str, str] | None = None, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VENV_BIN / "raytpu"), *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_input_is_one_line_before_anything_is_uploaded(capsys) -> None:
    from raytpu import cli

    # an absolute data path names one on the nodes: whatever data/ this working copy holds is not checked
    assert cli.main(["submit", "jobs/mshnet/small.yaml", NODES_DATA, "--address", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith("raytpu: error: cannot reach the Ray dashboard at http://127.0.0.1:9")
    assert cli.main(["submit", "jobs/mshnet/small.yaml", "optim.lrr=1", "--address", "http://127.0.0.1:9"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "raytpu: error: unknown config key 'optim.lrr'; did you mean optim.lr, optim, optim.scheduler?"
    )


def test_a_launch_submits_raytpu_launch_with_the_script_s_own_arguments_untouched() -> None:
    items = ["--address", "http://head:8265", "--no-wait", "--num_processes", "2", "--name", "ex"]
    items += ["examples/accelerate/train.py", "--address", "x", "--no-wait", "--epochs", "2"]
    address, wait, cfg, command = launch_entrypoint(items)
    assert (address, wait, cfg.run.name, cfg.scaling.num_workers) == ("http://head:8265", False, "ex", 2)
    assert command == (
        "raytpu launch --num_processes 2 --name ex examples/accelerate/train.py --address x --no-wait --epochs 2"
    )
    with pytest.raises(ValueError, match="script 'missing.py' not found"):
        launch_entrypoint(["--address", "http://head:8265", "missing.py"])


# ------------------------------------------------------------------ a real head
def ours(marker: str) -> list[int]:
    """Processes whose command line names our temp dir: the head and its workers, nobody else's."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="module")
def ray_head(stores):
    """`ray start --head --block` on loopback with free ports, its own temp dir and a token; stopped by
    signalling its process group (never `ray stop`, which would stop every Ray on this machine)."""
    token = secrets.token_hex(16)
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "PYTHONPATH": str(ROOT),
    }
    env.pop("RAY_ADDRESS", None)
    head, temp_dir, address = start_head(env, token)
    # Ray's job clients (this module's, and `ray job submit`'s) take RAY_ADDRESS (the session's own
    # local instance, once one runs) over the address they are given: this one they take first
    previous = os.environ.get("RAY_API_SERVER_ADDRESS")
    os.environ["RAY_API_SERVER_ADDRESS"] = address
    try:
        yield {"address": address, "token": token, "process": head, "temp_dir": temp_dir}
    finally:
        stop_head(head, temp_dir)
        os.environ.pop("RAY_API_SERVER_ADDRESS")
        if previous is not None:
            os.environ["RAY_API_SERVER_ADDRESS"] = previous


#: what `ray start` prints, in the head's temp dir
START_LOG = "ray-start.log"


def start_head(env: dict[str, str], token: str, tries: int = 3) -> tuple[subprocess.Popen, str, str]:
    """The head, its temp dir and its dashboard's address. A head that exits at start (on a loaded
    machine Ray gives its raylet 30 s to register and then gives up, after its dashboard has
    answered), or whose dashboard port answers for another cluster (a port picked free and taken
    before the head bound it), is started again on fresh ports."""
    for attempt in range(1, tries + 1):
        temp_dir = tempfile.mkdtemp(prefix="rtsub-", dir="/tmp")  # short: Ray's socket paths have a length limit
        flags = ("--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port")  # fmt: skip
        ports = dict(zip(flags, free_ports(len(flags)), strict=True))
        command = [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1"]
        command += [f"{flag}={port}" for flag, port in ports.items()]
        command += ["--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=2", f"--temp-dir={temp_dir}"]
        command += ["--disable-usage-stats"]
        log = Path(temp_dir) / START_LOG
        with log.open("w") as out:
            head = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        address = f"http://127.0.0.1:{ports['--dashboard-port']}"
        try:
            wait_for_dashboard(address, token, head, log)
            return head, temp_dir, address
        except BaseException as failed:  # never a head left running: stopped, then tried again or raised
            stop_head(head, temp_dir)
            if not isinstance(failed, HeadNotStarted) or attempt == tries:
                raise


class HeadNotStarted(AssertionError):
    """The head's `ray start` ended or gave up before its node started, or another cluster's dashboard answered."""


#: what ``ray start`` prints once its node has registered (the dashboard may answer before)
STARTED = "Ray runtime started."


def wait_for_dashboard(address: str, token: str, head: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Until ``ray start`` says its node started and the dashboard at ``address`` answers with our
    token (asked directly: Ray's job client would go to the session's own instance, whose address it
    takes from the environment first)."""
    request = urllib.request.Request(f"{address}/api/version", headers={"Authorization": f"Bearer {token}"})
    deadline = time.monotonic() + timeout
    while True:
        said = log.read_text()
        if head.poll() is not None or "Traceback (most recent call last)" in said:  # it gave up, or is giving up
            raise HeadNotStarted(said[-3000:])
        try:
            urllib.request.urlopen(request, timeout=5).close()
            if STARTED in said:
                return
        except urllib.error.HTTPError as refused:
            if refused.code in (401, 403):  # our token refused: another cluster's server took the port
                raise HeadNotStarted(f"{address} is another cluster's: {refused}") from refused
        except OSError:  # not listening yet
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the head at {address} did not start in {timeout:g} s: {said[-2000:]}")
        time.sleep(1)


def head_report(ray_head: dict) -> str:
    """The head's state and the last lines of its logs, for the message of a test that failed on it."""
    code = ray_head["process"].poll()
    state = "running" if code is None else f"exited with code {code}"
    temp_dir = Path(ray_head["temp_dir"])
    logs = temp_dir / "session_latest" / "logs"
    paths = [temp_dir / START_LOG, *sorted(logs.glob("*.err"))]
    paths += [logs / name for name in ("raylet.out", "gcs_server.out", "dashboard.log")]
    tails = [f"\n--- {path}\n{path.read_text(errors='replace')[-1500:]}" for path in paths if path.is_file()]
    return f"\nthe head: {state}" + "".join(tails)


def stop_head(head: subprocess.Popen, temp_dir: str) -> None:
    if head.poll() is None:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while ours(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in ours(temp_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.integration
def test_the_tpu_cluster_page_on_a_real_head(ray_head: dict, tmp_path: Path, monkeypatch, capsys) -> None:
    """The cluster page's commands (docs/tpu-cluster.md), in order, with this head standing in for
    `ray up`'s: its dashboard's address for the tunnel's, the tests' GCS server and bucket for the
    page's, the head's token where `ray get-auth-token --generate` finds it (in the page's home, as
    `ray up` would have copied the one made there). `raytpu submit` and plain `ray job submit` train
    into the bucket, `raytpu runs` lists the runs there, and a `ray job submit` tests the best
    checkpoint. Then `raytpu submit` without the token: one line, nothing submitted."""
    from raytpu import cli
    from tests.stores import BUCKET
    from tests.task_pages import commands, outputs, sandbox, script

    page = "tpu-cluster.md"
    folder = sandbox(tmp_path / "clone")
    home = tmp_path / "home"  # not in the folder the jobs upload
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(ray_head["token"])
    stand_ins = {"http://127.0.0.1:8265": ray_head["address"], "gs://my-raytpu-bucket": f"gs://{BUCKET}"}
    env = {**os.environ, "HOME": str(home), "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(["bash", "-c", script(page, stand_ins)], cwd=folder, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + head_report(ray_head)
    said = outputs(done.stdout)
    shown = commands(page)

    def output(start: str, nth: int = 0) -> str:
        return said[[i for i, command in enumerate(shown) if command.startswith(start)][nth]]

    assert "project_id: my-project-123456" in (folder / "cluster.yaml").read_text()
    assert output("ray get-auth-token").strip() == ray_head["token"]
    assert "succeeded" in output("raytpu submit").splitlines()[-1], output("raytpu submit")[-3000:]
    assert "mshnet-small" in output("raytpu runs $BUCKET/runs")
    listed = output("raytpu runs $BUCKET/runs/mshnet-small")
    assert "checkpoint_00000020" in listed and "best" in listed, listed
    assert '"test/mIoU"' in output("ray job submit", 1), output("ray job submit", 1)[-3000:]

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    assert cli.main(["submit", "examples/classifier.yaml", NODES_DATA, "--address", ray_head["address"]]) == 2
    assert "token authentication is on" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.integration
def test_submit_a_launch_to_a_real_head(ray_head: dict, tmp_path: Path) -> None:
    """`raytpu launch` as a Ray job, through plain `ray job submit` and through `raytpu submit launch`."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    auth = {"RAY_AUTH_TOKEN": ray_head["token"]}

    def launch_args(name: str) -> list[str]:
        options = ["--num_processes", "1", "--storage-path", str(tmp_path), "--name", name]
        script = ["examples/accelerate/train.py", "--epochs", "1", "--samples", "128", "--ckpt-every", "2"]
        return [*options, *script, "--results-dir", str(tmp_path / name / "out")]

    plain = subprocess.run(
        [str(VENV_BIN / "ray"), "job", "submit", "--address", ray_head["address"], "--no-wait"]
        + ["--working-dir", ".", "--submission-id", "plain-ray-launch", "--", "raytpu", "launch"]
        + launch_args("launch-via-ray"),
        cwd=ROOT,
        env={**os.environ, **auth, "RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-2000:] + head_report(ray_head)
    done = raytpu(
        "submit", "launch", "--address", ray_head["address"], *launch_args("launch-via-raytpu"), env=auth, timeout=400
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + head_report(ray_head)
    assert "submitted job:  raytpu-launch-via-raytpu-" in done.stdout
    assert "DistributedType" in done.stdout and "succeeded" in done.stdout.splitlines()[-1]
    client = JobSubmissionClient(ray_head["address"], headers={"Authorization": f"Bearer {ray_head['token']}"})
    deadline = time.monotonic() + 300
    while (status := client.get_job_status("plain-ray-launch")) not in (JobStatus.SUCCEEDED, JobStatus.FAILED):
        assert time.monotonic() < deadline, client.get_job_logs("plain-ray-launch")[-3000:]
        time.sleep(2)
    assert status == JobStatus.SUCCEEDED, client.get_job_logs("plain-ray-launch")[-3000:]
    for name in ("launch-via-ray", "launch-via-raytpu"):
        assert '"steps": 4' in (tmp_path / name / "logs" / "rank_0.log").read_text()
        assert list((tmp_path / name).glob("state_*"))
