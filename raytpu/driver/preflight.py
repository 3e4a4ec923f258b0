"""What the driver checks before a run starts: its data, its weights and the cluster's resources.

Every mistake found here is a :class:`~raytpu.config.ConfigError` (one ``raytpu: error:`` line,
exit 2) raised before a worker starts or a file of the run is written. The resource check
compares what a run asks for with what the cluster has, so that nothing waits forever for
a GPU, a TPU or a CPU that does not exist; a demand that only an autoscaler can meet is
announced as a wait, with what it waits for.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from raytpu.config import Config, ConfigError
from raytpu.errors import RunFailed
from raytpu.job import Job
from raytpu.storage.filesystems import check_location, diagnose, filesystem, is_remote
from raytpu.worker import checkpoint as ckpt

Bundle = dict[str, float]
#: resources a worker or a driver asks for that preflight compares with the nodes'
CHECKED = ("CPU", "GPU", "TPU")
#: seconds the bucket probe may take (connecting, credentials, a write, a read and a delete)
BUCKET_TIMEOUT_S = 30.0


# ---------------------------------------------------------------------- files
def check_storage(cfg: Config) -> None:
    """``run.storage_path``: a folder that can be made and written, or a bucket that takes a small
    write (checked from a subprocess with a time limit: a store that does not answer, or a client
    that waits for credentials, is an error within seconds, never a wait)."""
    check_storage_location(cfg.run.storage_path, "run.storage_path")


def check_storage_location(storage: str, what: str) -> None:
    check_location(storage, what)
    if is_remote(storage):
        check_bucket(storage, what)
    elif Path(storage).exists() and not Path(storage).is_dir():
        raise ConfigError(f"{what} {storage!r} is a file; runs are written to a folder: pass another path")
    else:
        check_writable_folder(Path(storage), what)


def check_writable_folder(folder: Path, what: str) -> None:
    """``folder`` exists (made here if not) and takes a file, or a one-line error naming ``what``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".raytpu-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{what}={folder}: cannot create or write this folder ({exc.strerror or exc}): "
            "pass a folder you may write, e.g. ./results, or a bucket (gs://BUCKET/PREFIX, s3://BUCKET/PREFIX)"
        ) from None


def check_bucket(location: str, what: str, timeout_s: float = BUCKET_TIMEOUT_S) -> None:
    code = "import sys; from raytpu.storage.filesystems import probe; probe(sys.argv[1])"
    try:
        done = subprocess.run([sys.executable, "-c", code, location], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"{what}={location}: no answer within {timeout_s:g} s (a store that does not answer, or no credentials "
            "found: set STORAGE_EMULATOR_HOST / AWS_ENDPOINT_URL for an emulator, or give the node credentials)"
        ) from None
    if done.returncode:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise ConfigError(f"{what}={location}: {diagnose(location, lines[-1] if lines else 'the probe failed')}")


def check_still_answering(storage: str) -> None:
    """After a failed run in a bucket: when the store no longer takes a write, that is the cause,
    said in one line (the run's last complete checkpoint is what the store already held)."""
    try:
        check_bucket(storage, "run.storage_path")
    except ConfigError as exc:
        raise RunFailed(
            f"the run's store stopped answering during the run ({exc}); the last complete checkpoint in it is kept: "
            "run the same command again once it answers"
        ) from None


def check_weights(cfg: Config) -> None:
    """``checkpoint.weights`` / ``--checkpoint``: loadable weights (copied here first from a bucket)."""
    weights = cfg.checkpoint.weights
    if not weights:
        return
    if is_remote(weights):
        check_location(weights, "--checkpoint")
        fs, path = filesystem(weights)
        try:
            found = fs.get_file_info(path).type != pafs.FileType.NotFound
        except OSError as exc:
            raise ConfigError(f"checkpoint {weights}: {diagnose(weights, str(exc))}") from exc
        if not found:
            raise ConfigError(f"checkpoint {weights!r} not found; {ckpt.EXPECTED}")
    ckpt.check_weights(weights)


def check_data(cfg: Config, job: Job, data_root: Path, mode: str) -> dict[str, int]:
    """The splits a run reads: present and their first sample readable; their sizes (checked
    against the batch once the plan is resolved: ``raytpu.config.batching.BatchPlan.check_split``)."""
    if cfg.data.loader == "ray":
        return prepared_sizes(cfg, job, mode)
    if not data_root.is_dir():
        raise ConfigError(f"data path {str(data_root)!r} is not a folder; pass the data set's folder (--data-path)")
    sizes = {}
    for split in ("train", "valid") if mode == "train" else ("test",):
        dataset = job.build_dataset(cfg, split, data_root)
        sizes[split] = len(dataset)
        if not sizes[split]:
            raise ConfigError(f"the {split} split of {data_root} is empty; add data or fix --data-path")
        try:
            dataset[0]
        except (ConfigError, FileNotFoundError, ValueError) as exc:
            raise ConfigError(f"the first {split} sample of {data_root} is unreadable: {exc}") from exc
    return sizes


def prepared_sizes(cfg: Config, job: Job, mode: str) -> dict[str, int]:
    from raytpu.job import Tabular, table_for
    from raytpu.storage.tables import open_prepared

    if not isinstance(job, Tabular):
        raise ConfigError(f"job {job.name!r} has no parquet tables (the Tabular capability): use data.loader=torch")
    prepared = open_prepared(cfg.data.path, job.name)
    splits = ("train", "valid") if mode == "train" else ("test",)
    return {split: int(prepared.table(table_for(job, cfg, split))["rows"]) for split in splits}


def check_local(cfg: Config) -> None:
    """``raytpu train --local`` runs what needs no Ray, in a run folder on this machine."""
    if is_remote(cfg.run.storage_path):
        raise ConfigError(
            f"--local writes its run folder on this machine: run.storage_path={cfg.run.storage_path} needs Ray "
            "(drop --local), or give a local folder"
        )
    if cfg.data.loader == "ray":
        raise ConfigError("--local runs without Ray: data.loader=ray needs it; use data.loader=torch or drop --local")
    if cfg.scaling.runtime == "xla" and cfg.scaling.num_workers > 1:
        raise ConfigError("--local with runtime=xla runs one worker (use xla.spmd=true for several devices)")


def check_sharded_workers(cfg: Config, runtime: str, accelerators: dict[str, float]) -> None:
    """FSDPv2 across several xla workers needs XLA collectives between them (TPU hosts, GPUs).
    Workers on the CPU PJRT device have none: their sharded gradients would be gathered to
    the host for gloo, a new graph per gradient at every step, until LLVM runs out of memory."""
    xla = cfg.xla
    sharded = runtime == "xla" and xla.spmd and xla.mesh.fsdp != 1
    if not sharded or cfg.scaling.num_workers == 1 or any(accelerators.values()):
        return
    raise ConfigError(
        f"FSDPv2 (xla.mesh.fsdp={xla.mesh.fsdp}) over {cfg.scaling.num_workers} workers of the CPU PJRT device: "
        "they share no XLA collectives; run scaling.num_workers=1, which drives all CPU_NUM_DEVICES devices"
    )


# ------------------------------------------------------------------ resources
@dataclass(frozen=True)
class Cluster:
    """What the resource check needs to know of a Ray cluster."""

    nodes: list[Bundle]  # every alive node's total resources
    available: Bundle  # free now, over the whole cluster
    ceiling: Bundle | None  # the most an autoscaler may ever provide (None: no autoscaler)


@dataclass(frozen=True)
class Fit:
    """``now``: starts at once; ``busy``: waits for resources other work holds; ``later``: waits for
    the autoscaler; ``never``: cannot run on this cluster."""

    verdict: str
    message: str


def worker_bundle(scaling: dict[str, Any]) -> Bundle:
    """One worker's resources from ``ScalingConfig`` arguments, as Ray Train reserves them."""
    bundle = {name: float(amount) for name, amount in scaling["resources_per_worker"].items() if amount}
    if scaling.get("use_gpu"):
        bundle.setdefault("GPU", 1.0)
    return bundle


def worker_bundles(cfg: Config) -> list[Bundle]:
    """One resource bundle per worker, as the run's ``TorchTrainer`` reserves them."""
    from raytpu.driver.ray_trainer import scaling_kwargs

    return [worker_bundle(scaling_kwargs(cfg))] * cfg.scaling.num_workers


def pack(bundles: Sequence[Bundle], capacities: Sequence[Bundle]) -> bool:
    """Whether ``bundles`` fit on the nodes' ``capacities`` (first fit, largest bundles first)."""
    free = [dict(node) for node in capacities]
    for bundle in sorted(bundles, key=lambda b: sorted(b.items()), reverse=True):
        node = next((n for n in free if all(n.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())), None)
        if node is None:
            return False
        for key, value in bundle.items():
            node[key] = node.get(key, 0.0) - value
    return True


def total(bundles: Sequence[Bundle]) -> Bundle:
    summed: Bundle = {}
    for bundle in bundles:
        for key, value in bundle.items():
            summed[key] = summed.get(key, 0.0) + value
    return summed


def describe(bundle: Bundle) -> str:
    return ", ".join(f"{value:g} {key}" for key, value in sorted(bundle.items()) if value) or "nothing"


def judge_fit(bundles: Sequence[Bundle], cluster: Cluster, what: str) -> Fit:
    """Compare a run's demand (one bundle per worker, plus a driver's) with the cluster."""
    need = total(bundles)
    have = total(cluster.nodes)
    if pack(bundles, cluster.nodes):
        if all(cluster.available.get(k, 0.0) + 1e-9 >= v for k, v in need.items()):
            return Fit("now", "")
        free = {k: v for k, v in cluster.available.items() if k in need}
        return Fit("busy", f"waiting for {describe(need)} held by other work (free now: {describe(free)})")
    if cluster.ceiling is not None and all(cluster.ceiling.get(k, 0.0) >= v for k, v in need.items()):
        return Fit(
            "later",
            f"waiting for the autoscaler to add nodes for {what} ({describe(need)}; the cluster "
            f"has {describe(have)} now)",
        )
    nodes = len(cluster.nodes)
    short = [key for key, value in need.items() if have.get(key, 0.0) + 1e-9 < value]
    if short:
        return Fit(
            "never",
            f"{what} needs {describe(need)} but the cluster has {describe(have)} on {nodes} "
            f"node(s); {remedy(short[0], have.get(short[0], 0.0))}",
        )
    largest = {key: max((n.get(key, 0.0) for n in cluster.nodes), default=0.0) for key in need}
    return Fit(
        "never",
        f"{what} needs {describe(need)}: the cluster's {nodes} node(s) have that in all but no "
        f"worker's share fits on one node (the largest node: {describe(largest)}); "
        f"{remedy(sorted(need)[0])}",
    )


def remedy(resource: str, have: float = 1.0) -> str:
    if resource == "GPU":
        lacking = "no GPU" if not have else "too few GPUs"
        return f"the cluster has {lacking}: use scaling.runtime=auto (or cpu), or fewer scaling.num_workers"
    if resource == "TPU":
        lacking = "no TPU" if not have else "too few TPU chips"
        return (
            f"the cluster has {lacking}: start Ray on the TPU hosts, or match scaling.tpu and num_workers to the slice"
        )
    if resource == "CPU":
        return "use fewer workers (scaling.num_workers) or a smaller scaling.cpus_per_worker"
    return f"remove {resource} from scaling.resources_per_worker or add nodes that have it"


def read_cluster() -> Cluster:
    """The connected cluster: alive nodes' totals, what is free, and an autoscaler's ceiling."""
    import ray
    from ray._private.state import state

    nodes = [
        {k: float(v) for k, v in node["Resources"].items() if k in CHECKED or k.startswith(("accelerator", "TPU-"))}
        for node in ray.nodes()
        if node.get("Alive")
    ]
    try:
        ceiling = state.get_max_resources_from_cluster_config()
    except Exception:  # no autoscaler state on this cluster
        ceiling = None
    return Cluster(nodes, {k: float(v) for k, v in ray.available_resources().items()}, ceiling or None)


def check_fit(bundles: Sequence[Bundle], what: str, cluster: Cluster | None = None) -> Fit:
    """Refuse a demand the cluster can never meet; say so when it has to wait."""
    result = judge_fit(bundles, cluster or read_cluster(), what)
    if result.verdict == "never":
        raise ConfigError(result.message)
    if result.message:
        print(f"raytpu: {result.message}", flush=True)
    return result


def concurrent_fits(trial: Sequence[Bundle], nodes: Sequence[Bundle], limit: int = 64) -> int:
    """How many trials with the bundles ``trial`` fit on ``nodes`` at once (at least 1)."""
    count = 1
    while count < limit and pack(list(trial) * (count + 1), nodes):
        count += 1
    return count
