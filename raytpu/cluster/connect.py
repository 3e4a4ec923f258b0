"""Joining a Ray cluster, or starting a local instance, without hanging: the address checked first
(a TCP check answers in seconds where nothing listens), its token, the driver's settings its
workers need, and Ray's own console lines kept to what a user acts on. What a cluster holds, for
``raytpu doctor``: ``raytpu.cluster.probe``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from raytpu.errors import ConfigError
from raytpu.storage.filesystems import endpoint_variables

DEFAULT_TIMEOUT_S = 30.0
#: how often Ray Train's controller looks at its workers (seconds), for raytpu's runs
HEALTH_CHECK, HEALTH_CHECK_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2"
#: the variable that sets the port of a new local instance's GCS (read by Ray when it starts one)
GCS_PORT = "RAY_GCS_SERVER_PORT"
#: the log files past which Ray's log monitor looks for new ones every 0.5 s instead of ten times a second
LOG_FILES_THRESHOLD = "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"
#: whether a raylet starts Python workers ahead of any task when the first driver joins (Ray's config)
PRESTART = "RAY_prestart_worker_first_driver"
#: a cluster's GCS address (``10.0.0.2:6379``), as ``ray start`` prints it; not ``auto`` nor ``ray://``
GCS_ADDRESS = re.compile(r"^[\w.-]+:\d+$")
#: the addresses of the local instances this process started
STARTED_HERE: list[str] = []
#: the clusters this process joined -> their dashboard's address ("": none)
DASHBOARDS: dict[str, str] = {}
#: whether a local Ray instance this process starts outlives the command that started it: from
#: Python (a notebook's next call reuses it, and it stops with the process), not on the command line
KEEP_LOCAL = contextvars.ContextVar("raytpu_keep_local_ray", default=True)
KEPT_LINE = (
    "raytpu: the local Ray instance stays up for the next call in this process; it stops when the process "
    "exits (ray.shutdown() stops it now)"
)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def resolve_address(address: str | None) -> str | None:
    """``--address``, else ``RAY_ADDRESS``; ``local`` or nothing means no cluster."""
    address = (address or os.environ.get("RAY_ADDRESS") or "").strip()
    return None if address in ("", "local") else address


def host_port(address: str) -> tuple[str, int] | None:
    """Where a Ray address listens: ``ray://h:10001``, ``http://h:8265``, ``h:6379``; None for ``auto``."""
    if address == "auto":
        return None
    defaults = {"ray": 10001, "http": 80, "https": 443}
    parsed = urlparse(address if "://" in address else f"gcs://{address}")
    if not parsed.hostname:
        return None
    return parsed.hostname, parsed.port or defaults.get(parsed.scheme, 6379)


def tcp_error(host: str, port: int, timeout: float) -> str | None:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return one_line(exc)


# ------------------------------------------------------------ joining as a driver
#: the Hugging Face libraries' cache, offline mode and endpoint as the driver has them, for its
#: workers to read the Hub as the driver's checks did (never a token: each node has its own login)
HUB_VARIABLES = ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                 "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")  # fmt: skip


#: where the workers of a local instance without a dashboard look for Ray's state API: nowhere.
#: Ray still records 127.0.0.1:8265 as its address, so its state clients would ask whichever
#: other instance on this machine serves a dashboard there; Ray Train's placement-group cleaner,
#: not finding a live run's controller in that one, took it for dead and removed the run's
#: workers. A port where nothing listens makes the look fail, and the cleaner keeps watching.
NO_STATE_API = "http://127.0.0.1:1"
#: what Ray's state and job clients read before any address (``RAY_ADDRESS`` included)
API_SERVER = "RAY_API_SERVER_ADDRESS"


def connect(address: str | None, quiet: bool = False, verbose: bool = False, dashboard: bool | None = None) -> None:
    """Join the cluster at ``address`` / ``RAY_ADDRESS``, or start a local Ray instance, with Ray's
    dashboard where ``dashboard`` is None (Ray's default: when it is installed) or True.

    An address where nothing answers is refused at once (Ray itself would retry for minutes)."""
    import ray

    if ray.is_initialized() and not leaves_kept_instance(address):
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    check_reachable(address)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)}
    env.update(endpoint_variables())  # where the stores are; never credentials: each node has its own
    env.update({name: os.environ[name] for name in HUB_VARIABLES if os.environ.get(name)})
    env["RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS"] = "0"
    # XLA's C++ warnings off from each worker's start, before any library loads XLA (a user's own level wins):
    # raytpu.runtime.xla.quiet_xla_logs says why
    env["TF_CPP_MIN_LOG_LEVEL"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")
    # TorchTPU's autoload off in every worker, as in the driver (raytpu/__init__.py): its runtime loads it
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    # print() in a worker stays print(): Ray Train would route it through a logger that writes it
    # to both stdout and stderr (each line twice on the console)
    env["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    # Ray Train's controller looks at its workers every 2 s by default, and each report and each
    # finished worker waits for a look: a launched script's last metrics took 16 s to drain after
    # it ended (0.5 s: 7 s; 0.2 s: 1 s), and a failure as long to notice. A value the user set wins.
    env[HEALTH_CHECK] = os.environ.get(HEALTH_CHECK, HEALTH_CHECK_S)
    runtime_env: dict[str, Any] = {"env_vars": env}
    if not verbose:
        runtime_env["worker_process_setup_hook"] = f"{__name__}.{quiet_train_controller.__name__}"
    kwargs: dict[str, Any] = {"runtime_env": runtime_env, "log_to_driver": not quiet}
    level = "INFO" if verbose else "WARNING"  # Ray's INFO lines (reports, checkpoints): --verbose only
    kwargs.update(logging_level=getattr(logging, level), logging_config=ray.LoggingConfig(log_level=level))
    local = address in (None, "local")
    started_with: dict[str, str] = {}
    if local:
        kwargs["include_dashboard"] = dashboard
        if address is None:
            print("raytpu: no Ray cluster given (--address / RAY_ADDRESS); starting a local Ray instance", flush=True)
        # the nodes of a local instance are never drained: Ray Train's preemption watcher (an actor
        # per run, whose start prints a C++ notice) has nothing to watch there
        env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
        # Ray's own lookups in the workers and actors of this run (Ray Train's placement-group
        # cleaner) must find this instance, even when another one runs on the machine
        port = free_port()
        env["RAY_ADDRESS"] = f"{ray.util.get_node_ip_address()}:{port}"
        started_with = instance_variables(port, dashboard)
    elif GCS_ADDRESS.match(address):
        env["RAY_ADDRESS"] = address  # the same for a cluster joined by its GCS address
        check_token(address)
    elif address == "auto":
        check_token(running_cluster() or "")
    if not verbose:
        quiet_ray()
    try:
        with environment(started_with):
            # no address: a new local instance, never another one found on this machine (a user's `ray start`)
            context = ray.init(address=address or "local", **kwargs)
    except ConnectionError as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ConfigError(f"cannot join a Ray cluster at {address!r}: {reason}{token_hint()}") from exc
    # and so do the driver's later lookups (Tune, Ray Train's threads in this process)
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    DASHBOARDS[os.environ["RAY_ADDRESS"]] = context.dashboard_url or ""
    if local:
        STARTED_HERE.append(os.environ["RAY_ADDRESS"])
        if KEEP_LOCAL.get():
            print(KEPT_LINE, flush=True)


def instance_variables(port: int, dashboard: bool | None) -> dict[str, str]:
    """What the processes of a new local instance read from the environment as they start: its GCS
    port, and, each unless the user set it:

    - Ray's log monitor looks for new worker log files every 0.5 s instead of ten times a second
      until the folder holds a thousand: the whole folder is listed each time, every worker that
      ever ran there in it, as a kept instance accumulates them (400 files: 4.5% of a core while
      idle, 2.3% at 0.5 s);
    - no Python workers started ahead of any task: Ray starts one a CPU without a runtime
      environment, and a raytpu job's tasks and actors all carry one (:func:`connect`), so none
      of them ever ran a task; the two of a 2-CPU instance imported Ray, then took 2.9% of a core
      while the instance waited (7.3% in all, 4.4% without them);
    - where there is no dashboard, no state API: the workers of every job look for it at
      :data:`NO_STATE_API` (the raylet started here passes the variable on).
    """
    variables = {LOG_FILES_THRESHOLD: "0", PRESTART: "0"}
    if dashboard is False:
        variables[API_SERVER] = NO_STATE_API
    return {name: value for name, value in variables.items() if name not in os.environ} | {GCS_PORT: str(port)}


@contextlib.contextmanager
def environment(variables: Mapping[str, str]) -> Iterator[None]:
    """``variables`` in this process's environment for the block's time, their earlier values
    (or their absence) restored after it."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def leaves_kept_instance(address: str | None) -> bool:
    """Whether a call names another cluster than the local instance kept from an earlier call
    (which is then stopped, and the named cluster joined)."""
    current = os.environ.get("RAY_ADDRESS", "")
    if address in (None, "", "local", current) or current not in STARTED_HERE:
        return False
    leave(keep=(), kept_too=True)
    return True


def starts_local_instance(address: str | None) -> bool:
    """Whether :func:`connect` would start a local Ray instance (this machine, nothing joined yet)."""
    ray = sys.modules.get("ray")
    joined_already = ray is not None and ray.is_initialized()
    return not joined_already and (address or os.environ.get("RAY_ADDRESS") or None) in (None, "local")


def running_cluster() -> str | None:
    """The GCS address ``auto`` names: ``RAY_ADDRESS``, else the cluster ``ray start`` last started here."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        return canonicalize_bootstrap_address("auto")
    except Exception:  # none running: ray.init says so
        return None


def has_token(environ: Mapping[str, str] = os.environ, home: Path | None = None) -> bool:
    """Whether this client would send a token: token mode, and a token where Ray looks for one."""
    return environ.get("RAY_AUTH_MODE", "") == "token" and bool(auth_headers(environ, home))


def token_hint() -> str:
    """What to check when a cluster could not be joined and this client sends no token (Ray 2.60
    clusters use token authentication by default), for every form of address; "" when it does."""
    if has_token():
        return ""
    return (
        "; if the cluster uses token authentication (Ray's default), export RAY_AUTH_MODE=token and put the "
        "cluster's token (the head's ~/.ray/auth_token) in RAY_AUTH_TOKEN or ~/.ray/auth_token"
    )


def auth_headers(environ: Mapping[str, str] = os.environ, home: Path | None = None) -> dict[str, str]:
    """Ray's bearer-token header from ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``
    (nothing when there is no token or ``RAY_AUTH_MODE=disabled``)."""
    if environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return {}
    token = environ.get("RAY_AUTH_TOKEN", "").strip()
    if not token:
        path = Path(environ["RAY_AUTH_TOKEN_PATH"]) if environ.get("RAY_AUTH_TOKEN_PATH") else None
        path = path or (home or Path.home()) / ".ray" / "auth_token"
        token = path.read_text().strip() if path.is_file() else ""
    return {"Authorization": f"Bearer {token}"} if token else {}


def check_token(address: str) -> None:
    """One look at the cluster's GCS, which answers at once when this client's token is missing or
    wrong (``ray.init`` would retry for 20 s and then say only that it failed to connect): a
    one-line error that says where the token goes."""
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    if not address:
        return
    try:
        GcsClient(address=address)
    except AuthenticationError:
        mode = os.environ.get("RAY_AUTH_MODE", "")
        setting = (
            "this client sends no token: export RAY_AUTH_MODE=token, and"
            if mode != "token"
            else "this client's token is not the cluster's:"
        )
        raise ConfigError(
            f"the Ray cluster at {address} uses token authentication and {setting} put the cluster's token "
            "(the head's ~/.ray/auth_token) in RAY_AUTH_TOKEN, in the file RAY_AUTH_TOKEN_PATH names, "
            "or in ~/.ray/auth_token"
        ) from None
    except Exception:  # anything else: ray.init says it, as before
        return


def leave(keep: Collection[str] = (), kept_too: bool = False) -> None:
    """Stop the local Ray instance this process started (while the command still times its
    shutdown: at the interpreter's exit it would take seconds no record sees), unless it is one
    of ``keep`` (started before the command, by its caller) or kept for the next call
    (:data:`KEEP_LOCAL`, unless ``kept_too``); a cluster it joined keeps running."""
    ray = sys.modules.get("ray")  # a --local run never imported it
    address = os.environ.get("RAY_ADDRESS", "")
    if KEEP_LOCAL.get() and not kept_too:
        return
    if ray is not None and ray.is_initialized() and address in STARTED_HERE and address not in keep:
        ray.shutdown()
        STARTED_HERE.remove(address)
        os.environ.pop("RAY_ADDRESS", None)


@contextlib.contextmanager
def ray_for_this_command() -> Iterator[None]:
    """The block is one command: a local Ray instance it starts is stopped when it ends, however
    it ends (an error found after joining, a failed run); one that ran before it keeps running."""
    before = tuple(STARTED_HERE)
    try:
        yield
    finally:
        leave(keep=before)


def joined() -> str:
    """The cluster this process joined, in words: the local instance it started, or the one at an address."""
    return "the local Ray instance" if joined_here() else f"the Ray cluster at {os.environ.get('RAY_ADDRESS', '')}"


def serves_state_api() -> bool | None:
    """Whether the cluster this process joined serves Ray's state API (its dashboard does); None
    where that is not known. A process that did not join through :func:`connect` (a Tune trial's)
    knows it of a local instance started without a dashboard: its raylet gave every worker
    :data:`NO_STATE_API`. A trial there that kept Ray Train's placement-group cleaner left it asking
    the missing API for ever (2% of a core each, for the instance's life)."""
    dashboard = DASHBOARDS.get(os.environ.get("RAY_ADDRESS", ""))
    if dashboard is None:
        return False if os.environ.get(API_SERVER) == NO_STATE_API else None
    return bool(dashboard)


def joined_here() -> bool:
    """Whether the Ray instance this process joined is one it started on this machine."""
    return os.environ.get("RAY_ADDRESS", "") in STARTED_HERE


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


#: Ray Train's client of the autoscaling coordinator: on a busy machine its request can time out,
#: and it logs the timeout's traceback with a warning that calls it safe to ignore
AUTOSCALING_CLIENT = "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"
#: Ray Train's elastic scaling policy (its look at the resources the autoscaling coordinator reserved)
ELASTIC_POLICY = "ray.train.v2._internal.execution.scaling_policy.elastic"
#: Ray Train's placement-group cleaner, which removes a dead controller's placement group
PLACEMENT_GROUP_CLEANER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
CLEANER_NOTICES = ("Detected that the Ray Train controller actor", "Failed to query Ray Train Controller actor state")


def quiet_train_controller() -> None:
    """Run in every process of the job as it starts: Ray Train's controller logs the traceback of
    an error in its loop (a store that stopped answering while it saved the run's state), which
    the driver then says in one line; its resource request's timeout is the warning alone, without
    the traceback. Filters, as Ray Train's logging set-up resets the level."""
    logger = logging.getLogger("ray.train.v2._internal.execution.controller.controller")
    logger.addFilter(lambda record: not record.getMessage().startswith("Error in control loop iteration"))
    # an elastic run's end, said by raytpu's controller callback (raytpu.cluster.elastic): one line on the driver
    logging.getLogger("ray.train.v2._internal.execution.callback_manager").addFilter(without_traceback)
    # a lost node's workers cannot shut their process group down, nor its placement-group cleaner stop:
    # Ray says it expects that, with a traceback each
    for name in ("backend_setup", "placement_group_callback"):
        logging.getLogger(f"ray.train.v2._internal.callbacks.{name}").addFilter(lambda record: False)
    # on a busy machine an elastic run's look at its reserved resources times out: Ray says so, and that it
    # keeps the group's size, with the timeout's traceback
    for name in (AUTOSCALING_CLIENT, ELASTIC_POLICY):
        logging.getLogger(name).addFilter(without_traceback)
    threading.excepthook = one_line_for(threading.excepthook, "PlacementGroupCleanerMonitor")
    # a controller Tune stopped (a trial ended early, or restarted from another's checkpoint by PBT):
    # Ray's cleaner then releases its placement group, which it says with the ids of everything involved;
    # and while a lost node's state is unknown, its look at the controller fails, said once a second
    logging.getLogger(PLACEMENT_GROUP_CLEANER).addFilter(
        lambda record: not record.getMessage().startswith(CLEANER_NOTICES)
    )


def one_line_for(hook: Callable[[Any], None], thread_name: str) -> Callable[[Any], None]:
    """``threading.excepthook`` where an error ending the thread ``thread_name`` (Ray Train's
    placement-group cleaner, whose look at the controller can time out on a busy machine) is one
    line, and every other thread's error is ``hook``'s."""

    def excepthook(args: Any) -> None:
        if args.thread is not None and args.thread.name == thread_name and args.exc_type is not SystemExit:
            print(f"{thread_name} stopped: {args.exc_type.__name__}: {args.exc_value}", file=sys.stderr, flush=True)
            return
        hook(args)

    return excepthook


def without_traceback(record: logging.LogRecord) -> bool:
    record.exc_info = record.exc_text = None
    return True


def quiet_ray() -> None:
    """Hide Ray's token-authentication reminder on every connect (through its logger's level), and
    its tracebacks for autoscaler events it could not parse (:func:`whole_events_only`)."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    logging.getLogger("ray._private.event.event_logger").addFilter(whole_events_only)


def whole_events_only(record: logging.LogRecord) -> bool:
    """Drop Ray's "Failed to parse event" error. The driver prints the autoscaler's events, which
    Ray's log monitor reads from the autoscaler's event file line by line; a line it reads while the
    autoscaler is still writing it comes in two halves, neither of them JSON, and the driver logs
    each with a traceback. The event is lost either way; the autoscaler's log keeps it."""
    return not record.getMessage().startswith("Failed to parse event")


def check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """A one-line error unless something listens where ``address`` points (none, ``local`` and
    ``auto`` need nothing: a local instance is started, or Ray finds the running one)."""
    if address in (None, "local", "auto"):
        return
    if address.startswith(("http://", "https://")):
        raise ConfigError(
            f"--address {address} is a dashboard address (for raytpu submit); to train on that cluster "
            "give its GCS address HOST:6379 or ray://HOST:10001"
        )
    endpoint = host_port(address)
    if endpoint is None:
        raise ConfigError(f"--address {address!r} is not a Ray address (HOST:PORT, ray://HOST:PORT, auto or local)")
    refused = tcp_error(*endpoint, timeout=timeout_s)
    if refused:
        raise ConfigError(
            f"no Ray cluster answers at {address} ({refused}); start one with `ray start --head`, fix --address / "
            "RAY_ADDRESS, or leave both unset to run on a local Ray instance"
        )
