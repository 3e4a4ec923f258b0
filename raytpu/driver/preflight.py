"""What the driver checks before a run starts: its data, its weights and the cluster's resources.

Every mistake found here is a :class:`~raytpu.config.ConfigError` (one ``raytpu: error:`` line,
exit 2) raised before a worker starts or a file of the run is written. The resource check
compares what a run asks for with what the cluster has, so that nothing waits forever for
a GPU, a TPU or a CPU that does not exist; a demand that only an autoscaler can meet is
announced as a wait, with what it waits for.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pyarrow.fs as pafs

from raytpu.cluster.connect import check_reachable, one_line
from raytpu.config import Config, ConfigError
from raytpu.config.origins import typed_on_command_line
from raytpu.config.plan import Plan, tracking, worker_range
from raytpu.corpus.prepare import corpus_words, is_text_run, prepare_text, streamed
from raytpu.errors import RunFailed, install_hint
from raytpu.job import Job, Synthesizes
from raytpu.records import checkpoints as ckpt
from raytpu.records import summary as run_summary
from raytpu.runtime.kinds import kind_of
from raytpu.runtime.placement import Bundle, ClusterOffer, Fit, judge_fit
from raytpu.storage.filesystems import check_location, diagnose, filesystem, is_remote
from raytpu.storage.run_folder import RunFolder

#: MLflow tracking stores that are databases (SQLAlchemy's), the default an SQLite file
DATABASE_STORES = ("sqlite:", "postgresql", "mysql", "mssql")

#: seconds the bucket probe may take (connecting, credentials, a write, a read and a delete)
BUCKET_TIMEOUT_S = 30.0


# ---------------------------------------------------------------------- files
def check_run(
    cfg: Config, job: Job | None, mode: str, address: str | None, local: bool
) -> tuple[Path | None, dict[str, int]]:
    """Every check that needs no cluster, in the order a user fixes them; the data root and the
    size of each split the run reads (none for ``raytpu launch``, whose script reads its own)."""
    if local and address:
        raise ConfigError("--local runs without Ray: drop --address (or drop --local to use the cluster)")
    if mode == "test" and not cfg.checkpoint.weights:
        raise ConfigError(
            "test mode needs weights: pass --checkpoint PATH (or --weight-path / checkpoint.weights=PATH)"
        )
    if local:
        check_local(cfg)
    else:
        check_reachable(address or os.environ.get("RAY_ADDRESS") or None)
    check_storage(cfg)
    check_weights(cfg)
    check_resume_from(cfg)
    if mode == "train":
        check_trackers(cfg)
    if job is None:
        return None, {}
    if is_text_run(cfg, job):  # a corpus of text: a streamed one is counted once Ray is joined
        data_root = prepare_text(cfg, job)
        return data_root, {} if streamed(cfg, job) else check_data(cfg, job, data_root, mode)
    data_root = resolve_data_root(cfg, job, synthesize=None if mode == "train" else False)
    return data_root, check_data(cfg, job, data_root, mode)


def check_trackers(cfg: Config, timeout_s: float = 10.0) -> None:
    """Each tracker of ``logging.report_to`` installed, an MLflow server that answers its health
    check, and W&B online only with a login: else one line, before anything starts."""
    log, found = cfg.logging, tracking(cfg)  # the settings as the workers get them
    for name in ("mlflow", "wandb"):
        if name in log.report_to and importlib.util.find_spec(name) is None:
            raise ConfigError(
                f"logging.report_to: {name} is not installed: {install_hint(name)}, or leave {name} out "
                "of --report_to / logging.report_to"
            )
    uri = found.get("logging.mlflow_tracking_uri", log.mlflow_tracking_uri)
    if "mlflow" in log.report_to and uri.startswith(DATABASE_STORES) and importlib.util.find_spec("sqlalchemy") is None:
        raise ConfigError(
            f"logging.report_to: MLflow's store {uri.split(':')[0]}:// needs sqlalchemy and alembic, which "
            f"{install_hint('mlflow')} installs with the MLflow client; or point MLFLOW_TRACKING_URI at a server"
        )
    if "mlflow" in log.report_to and uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"the MLflow tracking server at {uri} does not answer ({one_line(exc)}): start it (mlflow server), "
                "or point MLFLOW_TRACKING_URI / logging.mlflow_tracking_uri at one that runs"
            ) from None
    wandb_mode = found.get("logging.wandb_mode", log.wandb_mode)
    if "wandb" in log.report_to and wandb_mode == "online" and not wandb_logged_in():
        raise ConfigError(
            "W&B online needs a login on every node: set WANDB_API_KEY (or run wandb login), or run with "
            "WANDB_MODE=offline / logging.wandb_mode=offline and sync later (wandb sync)"
        )


def wandb_logged_in() -> bool:
    """An API key in the environment or in ``~/.netrc`` (what ``wandb login`` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace")


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


def check_resume_from(cfg: Config) -> None:
    """``checkpoint.resume_from`` / ``--resume_from_checkpoint PATH``: a whole raytpu checkpoint."""
    start = cfg.checkpoint.resume_from
    if not start:
        return
    if is_remote(start):
        check_location(start, "checkpoint.resume_from")
    folder = RunFolder(start)
    try:
        whole = folder.exists(ckpt.META)
    except OSError as exc:
        raise ConfigError(f"checkpoint.resume_from {start}: {diagnose(start, str(exc))}") from exc
    if not whole:
        raise ConfigError(
            f"checkpoint.resume_from {start!r} is not a whole raytpu checkpoint (a checkpoint_* folder with "
            f"{ckpt.META}); to start from weights alone pass --checkpoint PATH"
        )


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
        if not sizes[split] and is_text_run(cfg, job):
            what = "training" if split == "train" else "validation"
            raise ConfigError(
                f"{corpus_words(cfg, job, data_root)}: its {what} text holds fewer tokens than one block; add text "
                "or lower job.seq_len (--block_size)"
            )
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
    if is_remote(cfg.data.path):
        raise ConfigError(
            f"--local reads data from this machine's disk: data.path={cfg.data.path} is a bucket, which raytpu "
            "reads through Ray Data (drop --local), or copy the data to a folder here"
        )
    if cfg.data.loader == "ray":
        raise ConfigError("--local runs without Ray: data.loader=ray needs it; use data.loader=torch or drop --local")
    if worker_range(cfg):
        raise ConfigError(
            f"--local runs a fixed number of processes: scaling.num_workers={cfg.scaling.min_workers}:"
            f"{cfg.scaling.num_workers} (an elastic range) needs Ray (drop --local), or give one size"
        )


# ------------------------------------------------------------------ data
def resolve_data_root(cfg: Config, job: Job, synthesize: bool | None = None) -> Path:
    """``data.path`` if it exists; else synthesized there when ``synthesize`` (None: when
    ``data.synthesize_if_missing``); a path typed on the command line that does not exist is one
    error (never another folder); a config's own path falls back to ``./data/<job>`` (said in one
    note), else one error naming both. data.loader=ray: the prepared tables' folder (never
    synthesized)."""
    if cfg.data.loader == "ray":
        from raytpu.storage.tables import open_prepared

        prepared = open_prepared(cfg.data.path, job.name)
        return Path(prepared.base) if "://" not in cfg.data.path else Path(cfg.data.path)
    fallback = Path("data") / job.name
    given = Path(cfg.data.path) if cfg.data.path else None
    if given is not None and given.exists():
        return given.resolve()
    if given is None and job.data_in_memory:  # the job makes its samples itself: no folder to read
        return Path.cwd()
    allowed = cfg.data.synthesize_if_missing if synthesize is None else synthesize
    make = allowed and isinstance(job, Synthesizes)
    if make and given is not None:  # the set asked for, made with this run's seed: not another one
        return synthesize_data(cfg, job, given)
    if given is not None and typed_on_command_line("data.path"):
        synthetic = ", or make a synthetic set there with data.synthesize_if_missing=true"
        hint = synthetic if isinstance(job, Synthesizes) else ""
        raise ConfigError(f"data.path {str(given)!r} does not exist: give the data set's folder{hint}")
    if fallback.exists() and given != fallback:
        if given is not None:
            print(
                f"raytpu: note: data.path {str(given)!r} (the config's) does not exist here; using {str(fallback)!r}, "
                f"the {job.name} job's usual folder (give --data-path to choose)",
                flush=True,
            )
        return fallback.resolve()
    if make:
        return synthesize_data(cfg, job, fallback)
    named = f"{str(given)!r} nor " if given is not None else ""
    hint = f"make a synthetic set with `raytpu data synth {job.name} --out {given or fallback}`"
    raise ConfigError(
        f"no data: neither {named}{str(fallback)!r} exists; pass --data-path DIR"
        + (f", or {hint}" if isinstance(job, Synthesizes) else "")
    )


def synthesize_data(cfg: Config, job: Synthesizes, target: Path) -> Path:
    print(f"raytpu: data not found; synthesizing a small {cfg.job.name} data set in {target}", flush=True)
    job.synthesize(target, **job.synth_options(cfg))
    return target.resolve()


# ------------------------------------------------------------------ resources
def check_fit(bundles: Sequence[Bundle], what: str, offer: ClusterOffer) -> Fit:
    """Refuse a demand the cluster can never meet (one line naming what it has and can start, and
    the setting to change); a wait for other work's resources is bounded and said before the run
    (``raytpu.driver.ray_trainer.wait_for_workers``)."""
    result = judge_fit(bundles, offer, what)
    if result.verdict == "never":
        raise ConfigError(result.message)
    return result


def check_resume_sharding(plan: Plan) -> None:
    """A run resumed with another sharding than its newest checkpoint was written with is one line
    where the runtime lays them out apart (each rank's shards, or one model file), and resuming
    would fail on a worker. A launch never shards through raytpu: a run folder of sharded
    checkpoints (a ``raytpu train`` run's name) is refused the same way."""
    cfg = plan.config
    if plan.mode not in ("train", "launch") or not cfg.checkpoint.resume:
        return
    folder = RunFolder(plan.run_dir)
    found = run_summary.checkpoints(folder)
    if not found:
        return
    newest, sharded = found[-1], cfg.sharding.strategy != "none"
    scanned = bool(((newest.get("config") or {}).get("xla") or {}).get("scan_layers"))
    if plan.mode == "train" and scanned != cfg.xla.scan_layers:  # the optimizer state is the stack's, or the layers'
        raise ConfigError(
            f"{folder.uri(newest['name'])} was written with xla.scan_layers={str(scanned).lower()}: resume it so, "
            f"or start a new run.name from its weights (--checkpoint {folder.uri(newest['name'])})"
        )
    if not kind_of(cfg.scaling.runtime).sharded_checkpoints_differ:
        return
    if plan.mode == "launch" and newest.get("sharded"):
        raise ConfigError(
            f"{folder.uri(newest['name'])} was written by a sharded raytpu train run and a launched script "
            f"is not sharded by raytpu: give the launch its own --name (this one is run {cfg.run.name}'s)"
        )
    if bool(newest.get("sharded")) != sharded:
        written = "sharded" if newest.get("sharded") else "unsharded"
        raise ConfigError(
            f"{folder.uri(newest['name'])} was written by a {written} run and this run is "
            f"{'sharded' if sharded else 'unsharded'}: resume it with sharding.strategy="
            f"{'full_shard' if newest.get('sharded') else 'none'}, or start a new run.name from its weights "
            f"(--checkpoint {folder.uri(newest['name'])})"
        )


def check_placement(plan: Plan) -> None:
    """The plan's workers against what they need of each other, and what the cluster (or, with
    ``--local``, this machine) has and can start (the runtime's description says what it needs)."""
    cfg, offer = plan.config, plan.facts.offer
    kind = kind_of(cfg.scaling.runtime)
    kind.check_workers(cfg, offer)
    if plan.facts.local:
        kind.check_local(cfg, offer)
        return
    from raytpu.driver.ray_trainer import worker_bundles, workers_text

    check_fit(worker_bundles(cfg, smallest=True), workers_text(cfg, smallest=True), offer)


def check_plan(plan: Plan, job: Job | None) -> None:
    """The plan against the cluster, the model and the run folder: :func:`check_placement`,
    :func:`check_parallel` and :func:`check_resume_sharding`."""
    check_placement(plan)
    check_parallel(plan, job)
    check_resume_sharding(plan)


def check_parallel(plan: Plan, job: Job | None) -> None:
    """How the plan splits the model, against its runtime and the model itself (built on the meta
    device: no weights are made): slices need TPU slices, a scan the xla runtime and alike blocks,
    a tensor axis the model's own tensor-parallel plan, splitting whole heads."""
    cfg = plan.config
    runtime, tpu, tensor, scan = cfg.scaling.runtime, cfg.scaling.tpu, cfg.sharding.mesh.tensor, cfg.xla.scan_layers
    kind = kind_of(runtime)
    if (tpu.slices > 1 or tpu.min_slices) and kind.accelerator != "TPU":
        raise ConfigError(
            f"scaling.tpu.slices={tpu.slices}: slices are TPU slices, and this run is on the {runtime} runtime, "
            "which has none: set scaling.tpu.slices=1 (more workers: scaling.num_workers)"
        )
    if scan and not kind.scans_layers:
        raise ConfigError(
            f"xla.scan_layers runs on the xla runtime (torch_xla's scan), and this run is on {runtime}, where "
            "loop.compile compiles a repeated block once for all its copies: set xla.scan_layers=false"
        )
    if job is None or plan.mode == "launch" or (tensor <= 1 and not scan):
        return
    from raytpu.job import empty_build
    from raytpu.parallel.scan import layer_stack
    from raytpu.parallel.tensor import check_tensor_parallel
    from raytpu.runtime.torch_fsdp import units_of, wrapping_units

    with empty_build():  # a pretrained architecture from its config, on the meta device
        model = job.build_model(cfg)
    if tensor > 1:
        check_tensor_parallel(model, tensor)
    if scan:
        try:
            units = units_of(model, wrapping_units(model, list(cfg.sharding.layers)))
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if not units:
            raise ConfigError(
                f"xla.scan_layers scans the model's repeated blocks, and {type(model).__name__} declares none "
                "(Transformers' _no_split_modules): name their class in sharding.layers, or set xla.scan_layers=false"
            )
        layer_stack(model, units)
