"""Ray's own autoscaler on this machine, with the node types of ``cluster.yaml``, and raytpu used
against it as a user would: ``python -m tests.autoscaling_cluster OUT``, run by
``tests/test_autoscaling.py`` inside a PID namespace of its own (``unshare -fp --mount-proc``), so
that the ``ray stop`` of ``cluster.yaml``'s start commands, and the end of this process, reach only
this cluster's processes and never the test session's Ray.

The head is started by ``cluster.yaml``'s own ``head_start_ray_commands`` (``ray stop``, then
``RAY_AUTH_MODE=token ray start --head ... --autoscaling-config=...``), with free ports and a temp
dir of its own, and Ray's fake multi-node provider (``RAY_FAKE_CLUSTER=1``) as the autoscaler's
node provider: each node it launches is a local raylet with its node type's resources. The
autoscaling config is ``cluster.yaml``'s, mirrored (:func:`mirror`): the same node types with the
same accelerators, their CPUs capped at 2 (logical CPUs: a 224-CPU node would have Ray start
worker processes by the hundred on 2 cores), a multi-host slice as that many single-host nodes
(the fake provider launches one node per launch), idle nodes released after 6 s. Ray 2.60's wheel
lacks the fake provider's defaults file, so the provider is named as an ``external`` one.

What it does (one JSON line of what it saw, for the test to check), on the whole mirror: a
client without token mode; a request no node type can satisfy; ``raytpu submit`` of the
classifier of ``examples/`` (``scaling.runtime: auto``, a small model: the placement is the point)
through the head's job API, its run written to the test session's S3 bucket: which node types the
autoscaler launched, where every Train worker ran, and when the TPU node was released; TorchTPU
placed on a TPU node and refused there; a ``cuda`` run for which the autoscaler starts the GPU
node (whose worker then finds no real GPU: the request and the launch are what is checked, not
CUDA), the node released; a request that gives up after its limit; and ``raytpu doctor`` given
the dashboard's address (the node types read on the head by a Ray job). The runtime ``auto``
picks from other sets of node types (cuda where only GPU types are, one line for xla where no TPU
type is) is ``tests/test_placement.py``'s, on the same node types.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from tests.stores import free_ports

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
FAKE_HEAD_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"
FAKE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
#: the classifier of examples/ on one worker, a global batch of 4, one epoch
TINY = ["loop.epochs=1", "data.global_batch_size=4", "logging.progress_bar=false", "scaling.num_workers=1"]
CLASSIFIER = "examples/classifier.yaml"


# ------------------------------------------------------------------ the cluster
def mirror(launcher: dict[str, Any], keep: tuple[str, ...], gcs_port: int) -> dict[str, Any]:
    """``cluster.yaml``'s node types as an autoscaling config for the fake multi-node provider."""
    from raytpu.cluster.capacity import hosts_per_launch

    head_name = launcher["head_node_type"]
    head = dict(launcher["available_node_types"][head_name]["resources"])
    head["CPU"] = min(head.get("CPU", 0), 2)
    # the fake provider's name for the head
    types: dict[str, Any] = {"ray.head.default": {"resources": head, "node_config": {}, "max_workers": 0}}
    for name, spec in launcher["available_node_types"].items():
        if name == head_name or name not in keep:
            continue
        resources = dict(spec["resources"])
        resources["CPU"] = min(resources.get("CPU", 0), 2)
        hosts = hosts_per_launch(spec.get("node_config") or {})
        types[name] = {
            "resources": resources,
            "node_config": {},
            "min_workers": spec.get("min_workers", 0),
            "max_workers": spec.get("max_workers", launcher["max_workers"]) * hosts,
        }
    return {
        "cluster_name": "raytpu-fake",
        "max_workers": sum(t["max_workers"] for t in types.values()),
        "upscaling_speed": launcher["upscaling_speed"],
        "idle_timeout_minutes": 0.1,
        "provider": {
            "type": "external",
            "module": FAKE_PROVIDER,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": f"127.0.0.1:{gcs_port}",
            "launch_multiple": True,
            "head_node_id": FAKE_HEAD_ID,
        },
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": types,
        "head_node_type": "ray.head.default",
        **{key: [] for key in ("setup_commands", "head_setup_commands", "worker_setup_commands")},
        **{key: [] for key in ("head_start_ray_commands", "worker_start_ray_commands", "initialization_commands")},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


class Head:
    """The cluster's head, started by ``cluster.yaml``'s head start commands."""

    #: tries of the start commands, each on ports picked afresh: a port picked free can be taken
    #: by another process (the other test process's Ray) before the head binds it
    START_TRIES = 3

    def __init__(self, out: Path, keep: tuple[str, ...]) -> None:
        self.launcher = yaml.safe_load((ROOT / "cluster.yaml").read_text())
        self.keep = keep
        self.temp_dir = Path(out) / "ray"  # short: Ray's socket paths have a length limit
        self.config = Path(out) / "autoscaling.json"
        self.token = os.environ["RAY_AUTH_TOKEN"]
        self.env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        started = time.monotonic()
        for attempt in range(1, self.START_TRIES + 1):
            try:
                self._start()
                break
            except subprocess.CalledProcessError as failed:
                if attempt == self.START_TRIES:
                    raise RuntimeError(f"the head did not start:\n{failed.stdout}\n{failed.stderr}") from failed
        self.start_s = time.monotonic() - started

    def _start(self) -> None:
        """Run the head start commands on free ports (their ``ray stop`` clears a failed try's processes)."""
        self.ports = free_ports(10)
        self.gcs_port, self.dashboard_port = self.ports.pop(), self.ports.pop()
        self.gcs = f"127.0.0.1:{self.gcs_port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.config.write_text(json.dumps(mirror(self.launcher, self.keep, self.gcs_port)))
        fake = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_enable_autoscaler_v2": "1"}
        fake |= {"RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_ID, "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_ID}
        env = {**self.env, **fake}
        self.commands = [self.adapted(command, self.launcher) for command in self.launcher["head_start_ray_commands"]]
        for command in self.commands:
            subprocess.run(["bash", "-c", command], env=env, check=True, capture_output=True, text=True)

    def adapted(self, command: str, launcher: dict[str, Any]) -> str:
        """A start command of ``cluster.yaml`` on this machine: this cluster's config, ports and
        temp dir; the dashboard on a free port (jobs are submitted to it); CPUs as the head's type says."""
        command = " ".join(command.split())
        if "ray start" not in command:
            return command
        head = launcher["available_node_types"][launcher["head_node_type"]]
        replaced = (
            command.replace("--port=6379", f"--port={self.gcs_port}")
            .replace("--object-manager-port=8076", f"--object-manager-port={self.ports.pop()}")
            .replace("--autoscaling-config=~/ray_bootstrap_config.yaml", f"--autoscaling-config={self.config}")
        )
        ports = {"--dashboard-port": self.dashboard_port}
        for flag in ("--ray-client-server-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port"):
            ports[flag] = self.ports.pop()
        for flag in ("--metrics-export-port", "--runtime-env-agent-port", "--node-manager-port"):
            ports[flag] = self.ports.pop()
        extra = [f"{flag}={port}" for flag, port in ports.items()]
        extra += ["--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", "--include-dashboard=true"]
        extra += [f"--num-cpus={min(head['resources'].get('CPU', 0), 2):g}", f"--temp-dir={self.temp_dir}"]
        extra += ["--disable-usage-stats"]
        return f"{replaced} {' '.join(extra)}"

    def join(self) -> None:
        import ray

        ray.init(address=self.gcs, logging_level="ERROR", log_to_driver=False)


class NodeWatch:
    """The node types of this cluster's nodes, seen every half second through the autoscaler's status."""

    def __init__(self, gcs: str) -> None:
        self.gcs, self.seen, self.types_of = gcs, set(), {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def now(self) -> set[str]:
        """The node types of the nodes up, starting or being launched (the head's is ``node_<id>``)."""
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(self.gcs)
        nodes = status.active_nodes + status.idle_nodes + status.pending_nodes
        self.types_of.update({node.node_id: node.ray_node_type_name for node in nodes if node.node_id})
        return {node.ray_node_type_name for node in nodes if node.ray_node_type_name} | {
            launch.ray_node_type_name for launch in status.pending_launches
        }

    def _watch(self) -> None:
        while not self.done.wait(0.5):
            try:
                self.seen |= self.now()
            except Exception:  # the GCS busy for a moment: the next look sees it
                continue

    def wait_until_gone(self, name: str, timeout: float) -> float | None:
        """Seconds until no node of type ``name`` is left (None: still there after ``timeout``)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            try:
                if name not in self.now():
                    return time.monotonic() - start
            except Exception:
                pass
            time.sleep(0.5)
        return None

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def raytpu(args: list[str], env: dict[str, str], timeout: float = 600) -> dict[str, Any]:
    started = time.monotonic()
    done = subprocess.run(
        [str(VENV_BIN / "raytpu"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    return {"code": done.returncode, "out": done.stdout, "err": done.stderr, "seconds": time.monotonic() - started}


# ------------------------------------------------------------------ the scenario
def scenario(out: Path) -> dict[str, Any]:
    head = Head(out, ("tpu_v5e_8", "tpu_v5e_16_slice", "gpu_t4"))
    report: dict[str, Any] = {"start_commands": head.commands, "head_start_s": head.start_s}
    head.join()
    watch = NodeWatch(head.gcs)
    data = f"data.path={out / 'data'}"  # a folder every node of this machine has (the driver makes it)
    train = ["train", CLASSIFIER, "--address", head.gcs, *TINY, data, f"run.storage_path={out / 'results'}"]
    no_mode = {k: v for k, v in head.env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    report["no_token_mode"] = raytpu(train, {**no_mode, "HOME": str(out / "empty-home")}, timeout=120)
    report["impossible"] = raytpu([*train, "scaling.runtime=cuda", 'scaling.resources_per_worker={"GPU": 8}'], head.env)
    report["types_before_submit"] = sorted(watch.seen)
    runs = os.environ["RAYTPU_AUTOSCALING_RUNS"]
    submit = ["submit", CLASSIFIER, *TINY, data, f"run.storage_path={runs}", "run.name=on-demand"]
    submit += ["--address", head.dashboard]
    report["submit"] = raytpu(submit, head.env, timeout=900)
    report["types_launched"] = sorted(watch.seen)
    report["workers"] = [{**w, "node_type": watch.types_of.get(w["node_id"])} for w in train_workers(head.dashboard)]
    report["runtime_env"] = submitted_runtime_env(head)
    # TorchTPU on the TPU node: a worker on a chip, over tpu_dist, which the fake node (no torch_tpu) refuses
    report["torch_tpu"] = raytpu([*train, "scaling.runtime=torch_tpu"], head.env, timeout=300)
    earlier = {w["actor_id"] for w in report["workers"]}
    report["torch_tpu_workers"] = [
        {**w, "node_type": watch.types_of.get(w["node_id"])}
        for w in train_workers(head.dashboard)
        if w["actor_id"] not in earlier
    ]
    report["tpu_released_after_s"] = watch.wait_until_gone("tpu_v5e_8", timeout=120)
    watch.wait_until_gone("tpu_v5e_16_slice", timeout=120)  # a host TorchTPU's worker may have started
    watch.seen.clear()
    report["cuda"] = raytpu([*train, "scaling.runtime=cuda"], head.env)
    report["types_launched_for_cuda"] = sorted(watch.seen)
    report["gpu_released_after_s"] = watch.wait_until_gone("gpu_t4", timeout=120)
    report["gives_up"] = raytpu([*train, "scaling.runtime=cuda", "scaling.node_start_timeout_s=0.5"], head.env)
    report["doctor"] = raytpu(["doctor", "--json", "--timeout", "120", "--address", head.dashboard], head.env)
    watch.stop()
    return report


def train_workers(dashboard: str) -> list[dict[str, Any]]:
    """Every Ray Train worker actor the cluster ran (dead ones included) and its node."""
    from ray.util.state import list_actors

    workers = [("class_name", "=", "RayTrainWorker")]
    actors = list_actors(address=dashboard, filters=workers, detail=True, raise_on_missing_output=False)
    return [{"actor_id": actor.actor_id, "node_id": actor.node_id, "state": actor.state} for actor in actors]


def submitted_runtime_env(head: Head) -> list[Any]:
    """The runtime environments of the jobs submitted to the head, as its job API keeps them."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(head.dashboard, headers={"Authorization": f"Bearer {head.token}"})
    return [job.runtime_env for job in client.list_jobs()]


def main(out: Path) -> None:
    """The cluster's token and a home of its own (nothing lands in the user's ``~/.ray``), in the
    environment of this process (before Ray reads it) and of everything it starts."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "home").mkdir(exist_ok=True)
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "HOME": str(out / "home")})
    os.environ.pop("RAY_ADDRESS", None)
    report = scenario(out)
    print(json.dumps(report), flush=True)
    subprocess.run(["bash", "-c", shlex.join([str(VENV_BIN / "ray"), "stop", "--force"])], capture_output=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
