"""``raytpu submit CONFIG [overrides] [--address URL] [--no-wait]``: ``raytpu train`` as a Ray job
(``raytpu submit launch [--address URL] [--no-wait] [launch options] SCRIPT [args]``: ``raytpu launch``).

A thin layer over Ray's ``JobSubmissionClient`` (what ``ray job submit`` calls): the config is
checked here first, so that a bad key fails before anything is uploaded; the project folder
(the current directory, less data, results and environments) becomes the job's working
directory, so ``jobs/`` and the config travel with it; the entrypoint is ``raytpu train CONFIG
OVERRIDES``, which runs on the head node and joins the cluster through the ``RAY_ADDRESS`` Ray
sets for jobs. raytpu itself must be installed on every node (``cluster.yaml`` does it).

Token authentication (on by default in Ray 2.60) is passed on: the token is read from
``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token`` and sent as a
bearer header, whether or not ``RAY_AUTH_MODE=token`` is exported here.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.util
import logging
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytpu.cluster.connect import API_SERVER, auth_headers, environment
from raytpu.config import Config, load_config
from raytpu.config.args import extract
from raytpu.job import job_module
from raytpu.storage.filesystems import check_location, join

# Never uploaded with the working directory (gitignore syntax, relative to it): data sets,
# run outputs, environments and caches. Ray refuses working directories over 500 MiB.
EXCLUDES = [
    "/data",
    "/results",
    "/.venv",
    "/venv",
    "/.git",
    "__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
    "*.safetensors",
    "*.pt",
    "*.pth",
]


class SubmitError(ValueError):
    """A submission problem the user can fix (a ValueError, so the CLI prints one line)."""


def split_args(items: list[str]) -> tuple[str | None, bool, list[str]]:
    """``(address, wait, overrides)`` from what follows the config on the command line."""
    rest, found = extract(items, valued=["--address"], switches=["--no-wait"])
    return found.get("--address", [None])[0], "--no-wait" not in found, rest


def dashboard_url(address: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The Ray dashboard URL jobs are submitted to: ``--address``, else ``RAY_ADDRESS``; ``http://`` if no scheme."""
    address = address or environ.get("RAY_ADDRESS") or ""
    if not address:
        raise SubmitError(
            "submit needs the cluster's dashboard address: --address http://HEAD:8265 (or export RAY_ADDRESS)"
        )
    if address.startswith("ray://") or address == "auto":
        raise SubmitError(f"--address {address!r}: jobs are submitted to the dashboard, e.g. http://HEAD:8265")
    return address if "://" in address else f"http://{address}"


def entrypoint(config: str, overrides: list[str]) -> str:
    """The shell command the job runs on the head node."""
    return shlex.join(["raytpu", "train", config, *overrides])


def runtime_env(project: Path, py_modules: tuple[str, ...] = ()) -> dict[str, Any]:
    """The job's runtime environment: the project folder as working directory, without its data and
    outputs, and the job's own package when it lives elsewhere."""
    env: dict[str, Any] = {"working_dir": str(project), "excludes": list(EXCLUDES)}
    if py_modules:
        env["py_modules"] = list(py_modules)
    return env


def submission_id(run_name: str, now: datetime.datetime | None = None) -> str:
    """A readable, unique job id: ``raytpu-<run name>-<UTC time>``."""
    stamp = (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y%m%d-%H%M%S")
    return f"raytpu-{re.sub(r'[^A-Za-z0-9_-]+', '-', run_name)}-{stamp}"


@dataclass(frozen=True)
class Shipment:
    """What a job takes to the cluster: the config as the cluster names it (relative to the working
    directory), extra Python packages (``runtime_env`` ``py_modules``), and notes for the console."""

    config: str
    py_modules: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def shipment(cfg: Config, job_module: str, config: str, project: Path) -> Shipment:
    """Check, before anything is submitted, that the job finds on the cluster what it finds here:
    the config and the data (a relative path that only this machine has is one error that says what
    to do), the job module (one outside the project folder travels as a ``py_modules`` package)."""
    path = Path(config)
    if not uploaded(path, project):
        raise SubmitError(
            f"the config {config} is not in what raytpu submit uploads (the folder {project}, less data/, "
            "results/ and what .gitignore leaves out): move it into the project folder, or submit from "
            "a folder that holds it"
        )
    notes = [storage_note(cfg)] if not _is_absolute(cfg.run.storage_path) else []
    notes += data_notes(cfg, project)
    return Shipment(
        str(path.resolve().relative_to(project.resolve())), tuple(job_packages(job_module, project)), tuple(notes)
    )


def uploaded(path: Path, project: Path) -> bool:
    """Whether Ray's packing of the working directory ``project`` takes ``path``: inside it, and
    neither it nor a folder above it excluded (:data:`EXCLUDES`, the project's .gitignore and
    .rayignore, matched by Ray's own functions, as when it packs)."""
    from ray._private.runtime_env.packaging import _get_excludes, get_excludes_from_ignore_files

    project, path = project.resolve(), path.resolve()
    if not path.is_relative_to(project):
        return False
    quiet = logging.getLogger(f"{__name__}.packaging")
    rules = [_get_excludes(project, EXCLUDES), *get_excludes_from_ignore_files(project, True, logger=quiet)]
    inside = [path, *path.parents[: len(path.parents) - len(project.parents) - 1]]
    return not any(rule(part) for rule in rules for part in inside)


def storage_note(cfg: Config) -> str:
    return (
        f"run.storage_path {cfg.run.storage_path!r} is relative: on the cluster it is inside the job's "
        "temporary working directory; pass a bucket (gs://BUCKET/runs) or a folder every node mounts (NFS)"
    )


def data_notes(cfg: Config, project: Path) -> list[str]:
    """A relative ``data.path``: uploaded with the project, or made by the job on the cluster, or
    an error (it exists only here, or nowhere); an absolute one names a path on the nodes."""
    data = cfg.data.path
    if not data or _is_absolute(data):
        return []
    here = project / data
    holds_data = here.is_file() or (here.is_dir() and any(here.iterdir()))
    if holds_data and uploaded(here, project):
        return [f"data.path {data!r} travels with the job (Ray uploads at most 500 MiB: a larger set goes in a bucket)"]
    if cfg.data.synthesize_if_missing and not holds_data:  # made on the cluster only where no data is
        return [
            f"data.path {data!r} holds no data here: the job synthesizes a small set there on the cluster "
            "(data.synthesize_if_missing)"
        ]
    if holds_data:  # the user's data: never replaced by a synthetic set on the cluster
        raise SubmitError(
            f"data.path {data!r} is on this machine only (raytpu submit does not upload data/, results/ nor what "
            f".gitignore leaves out): put it in a bucket (`raytpu data prepare {cfg.job.name} --src {data} --out "
            "gs://BUCKET/PREFIX`, then data.path=gs://BUCKET/PREFIX), on a path every node has (data.path=/mnt/...), "
            "or, if small, in a folder of the project that is uploaded with it"
        )
    raise SubmitError(
        f"data.path {data!r} exists neither here nor, relative to the job's working directory, on the cluster: "
        "give a path every node has (data.path=/mnt/...) or a bucket (data.path=gs://BUCKET/PREFIX)"
    )


def job_packages(module: str, project: Path) -> list[str]:
    """The job module's top-level package when it lives outside the project folder (and outside
    raytpu, which every node has installed): it travels as a ``py_modules`` folder."""
    spec = importlib.util.find_spec(module)
    origin = Path(spec.origin) if spec and spec.origin else None
    if origin is None or module.startswith("raytpu.") or uploaded(origin, project):
        return []
    top = importlib.util.find_spec(module.split(".")[0])
    locations = list(top.submodule_search_locations or []) if top else []
    if not locations:
        raise SubmitError(
            f"job module {module} is a single file outside {project}: put it in a package (a folder with "
            "__init__.py), which raytpu submit sends with the job, or in the project folder"
        )
    return [str(Path(locations[0]).resolve())]


def follow_up(address: str, job_id: str, cfg: Config) -> list[str]:
    """What to run next: logs, status, stop, and TensorBoard on the run's folder."""
    where = f"--address {address}"
    board = join(cfg.run.storage_path, cfg.run.name, "tensorboard")
    return [
        f"submitted job:  {job_id}",
        f"follow logs:    ray job logs {where} --follow {job_id}",
        f"status:         ray job status {where} {job_id}",
        f"stop:           ray job stop {where} {job_id}",
        f"tensorboard:    tensorboard --logdir {board}   (where run.storage_path is: the head node or shared storage)",
        f"dashboard:      {address}",
    ]


def _is_absolute(path: str) -> bool:
    return "://" in path or Path(path).is_absolute()


def connect(address: str) -> Any:
    """A ``JobSubmissionClient`` for ``address``, or a one-line error saying what is wrong."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    # Ray's client takes RAY_ADDRESS over the address it is given: the URL named here must win
    try:
        with environment({API_SERVER: address}):
            return JobSubmissionClient(address, headers=auth_headers())
    except ConnectionError as exc:
        reason = _first_line(exc)
        raise SubmitError(f"cannot reach the Ray dashboard at {address}: is the cluster up? ({reason})") from exc
    except (AuthenticationError, RuntimeError) as exc:
        raise SubmitError(_auth_message(address, exc)) from exc


def _auth_message(address: str, exc: BaseException) -> str:
    text = _first_line(exc)
    if "authentication" in str(exc).lower() or "401" in text or "403" in text:
        return (
            f"{address} refused the request ({text}); token authentication is on: put the cluster's token "
            "in ~/.ray/auth_token or export RAY_AUTH_TOKEN"
        )
    return f"{address}: {text}"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def wait_for(client: Any, job_id: str) -> str:
    """Stream the job's logs until it ends; its final status."""

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    asyncio.run(tail())
    return str(client.get_job_status(job_id).value)


def launch_entrypoint(items: list[str]) -> tuple[str | None, bool, Config, str]:
    """``raytpu submit launch [--address URL] [--no-wait] [launch options] SCRIPT [args]``:
    ``(address, wait, cfg, entrypoint)``. The options are checked as ``raytpu launch`` checks
    them; ``--address`` is the dashboard's here (on the cluster the job finds it in
    ``RAY_ADDRESS``); the script and its arguments pass through untouched."""
    from raytpu.config.args import Parser
    from raytpu.driver.launch import LAUNCH_TEXT, add_launch_arguments, settings_from

    parser = Parser(prog="raytpu submit launch", description=LAUNCH_TEXT)
    add_launch_arguments(parser)
    parser.add_argument("--no-wait", action="store_true", help="submit and return")
    args = parser.parse_args(items)
    settings = settings_from(args)
    options, found = extract(items[: len(items) - len(args.script_args) - 1], ["--address"], switches=["--no-wait"])
    command = ["raytpu", "launch", *options, args.script, *args.script_args]
    return found.get("--address", [None])[0], "--no-wait" not in found, settings.config, shlex.join(command)


def main(config: str, overrides: list[str]) -> int:
    """Check the config, submit the job, print how to follow it; with waiting, its exit status."""
    project = Path.cwd()
    if config == "launch":
        address, wait, cfg, command = launch_entrypoint(overrides)
    else:
        address, wait, overrides = split_args(overrides)
        cfg, _ = load_config(config, overrides)  # a bad key fails here, before anything is uploaded
    check_location(cfg.run.storage_path, "run.storage_path")  # the cluster checks that it can write there
    if config == "launch":
        ship = Shipment(config)
    else:  # the data and the job module, once the storage is one the cluster may be given
        ship = shipment(cfg, job_module(cfg.job.name), config, project)
        command = entrypoint(ship.config, overrides)
    url = dashboard_url(address)
    client = connect(url)
    for note in ship.notes:
        print(f"raytpu: {note}", file=sys.stderr)
    try:
        job_id = client.submit_job(
            entrypoint=command,
            submission_id=submission_id(cfg.run.name),
            runtime_env=runtime_env(project, ship.py_modules),
            metadata={"raytpu_config": config, "raytpu_run": cfg.run.name},
        )
    except Exception as exc:  # the SDK raises RuntimeError or AuthenticationError, both with a readable first line
        raise SubmitError(_auth_message(url, exc)) from exc
    print("\n".join(follow_up(url, job_id, cfg)), flush=True)
    if not wait:
        return 0
    try:
        status = wait_for(client, job_id)
    except KeyboardInterrupt:
        print(f"raytpu: stopped following; the job keeps running (ray job stop --address {url} {job_id})")
        return 130
    if status != "SUCCEEDED":
        info = client.get_job_info(job_id)
        print(f"raytpu: error: job {job_id} {status}: {_first_line(Exception(info.message or ''))}", file=sys.stderr)
        return 1
    print(f"job {job_id} succeeded", flush=True)
    return 0
