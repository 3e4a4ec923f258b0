"""A user's mistakes end in one ``raytpu: error:`` line and exit 2, fast, with no traceback and
nothing lost: every case below points at the same earlier run, whose files must stay unchanged.

Most cases go through ``raytpu.cli.main()`` in this process; the ones that need a cluster use
the session's local Ray instance (2 CPUs, no GPU); a few go through the real ``raytpu``
executable, as a user types them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from raytpu import cli
from raytpu.config import load_config
from raytpu.runtime import make_runtime
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter

ROOT = Path(__file__).resolve().parents[1]
SMALL = str(ROOT / "jobs/mshnet/small.yaml")
LM = str(ROOT / "jobs/causal_lm/small.yaml")
RAYTPU = str(Path(sys.executable).with_name("raytpu"))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """An IRSTD-format data set, an earlier run with a checkpoint, and files to misuse."""
    from raytpu.jobs.mshnet.synth import synthesize

    base = tmp_path_factory.mktemp("bad-input")
    data = base / "mshnet"
    synthesize(data, n=24, size=32, seed=0)
    storage = base / "results"
    earlier = storage / "earlier"
    cfg, job = load_config(None, ["job.name=tests.toy_job", "loop.epochs=1", "logging.progress_bar=false"])
    Trainer(cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), earlier, earlier, FolderReporter(earlier)).fit()
    junk = base / "junk.pt"
    junk.write_text("not a checkpoint")
    (base / "broken.yaml").write_text("job: {name: mshnet}\nloop:\n  epochs: [1, 2\n")
    (base / "latin1.yaml").write_bytes(b"job: {name: mshnet}\n# \xff\xfe Latin-1\n")
    (base / "fast.yaml").write_text("job: {name: mshnet}\noptim:\n  lr: fast\n")
    (base / "misspelt.yaml").write_text("job: {name: mshnet}\nloop:\n  log_every: 5\n  epoch: 3\n")
    corrupt = base / "corrupt"
    shutil.copytree(data, corrupt)
    first = (corrupt / "trainval.txt").read_text().split()[0]
    (corrupt / "images" / f"{first}.png").write_bytes(b"\x89PNG truncated")
    no_list = base / "no-list"
    shutil.copytree(data, no_list)
    (no_list / "trainval.txt").unlink()
    cdeit = base / "cdeit"
    for split in ("train", "valid", "test"):
        (cdeit / split).mkdir(parents=True)
        for index in range(4):
            arrays = {"xs": np.zeros((32, 32), np.float32), "ys": np.zeros((208, 1), np.float32)}
            np.savez(cdeit / split / f"{index}.npz", TR=np.zeros((32, 32), np.float32), **arrays)
    torch.save(torch.ones(208), cdeit / "std.pth")
    (cdeit / "mean.pth").write_text("garbage")
    return {"base": base, "data": data, "storage": storage, "earlier": earlier, "junk": junk, "corrupt": corrupt}


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def common(world) -> list[str]:
    """Overrides that aim every command at the earlier run's folder and the small data set."""
    return [f"run.storage_path={world['storage']}", "run.name=earlier", f"data.path={world['data']}"]


def with_overrides(argv: list[str], overrides: list[str]) -> list[str]:
    """``overrides`` right after the config of a train/test/tune command, before the case's own words."""
    if len(argv) < 2 or argv[0] not in ("train", "test", "tune"):
        return argv
    return [*argv[:2], *overrides, *argv[2:]]


def assert_one_error_line(code: int, out: str, err: str, expected: str) -> None:
    errors = [line for line in err.splitlines() if line.startswith("raytpu: error:")]
    assert code == 2, (code, out[-2000:], err[-2000:])
    assert len(errors) == 1, err
    assert expected in errors[0], errors[0]
    assert "Traceback" not in out + err, err


CASES = {  # name: (argv after `raytpu`, text the error line must contain)
    "negative epochs": (["train", SMALL, "loop.epochs=-3"], "loop.epochs must be at least 1, got -3"),
    "nan lr": (["train", SMALL, "optim.lr=nan"], "optim.lr must be a finite number"),
    "zero lr": (["train", SMALL, "--lr", "0"], "optim.lr must be greater than 0"),
    "override without value": (["train", SMALL, "optim.lr="], "has no value; write optim.lr=VALUE"),
    "zero batch": (["train", SMALL, "data.global_batch_size=0"], "data.global_batch_size must be at least 1"),
    "batch not divisible": (["train", SMALL, "--batch-size", "7"], "use a multiple of 2"),
    "no workers": (["train", SMALL, "num_workers=0"], "scaling.num_workers must be at least 1"),
    "unknown runtime": (["train", SMALL, "runtime=tpu"], "scaling.runtime='tpu' is not one of auto, cpu, cuda, xla"),
    "unknown precision": (["train", SMALL, "precision=fp4"], "scaling.precision='fp4' is not one of"),
    "fp8 on CPUs": (["train", SMALL, "precision=fp8"], "scaling.precision=fp8 needs NVIDIA GPUs with float8"),
    "unknown loader": (["train", SMALL, "data.loader=spark"], "data.loader='spark' is not one of torch, ray"),
    "unknown scheduler": (["train", SMALL, "optim.scheduler=step"], "optim.scheduler='step' is not one of"),
    "negative max_steps": (["train", SMALL, "loop.max_steps=-1"], "loop.max_steps must be at least 0"),
    "negative weight decay": (["train", SMALL, "optim.weight_decay=-0.1"], "optim.weight_decay must be at least 0"),
    "ema beta of 1.5": (["train", SMALL, "loop.ema_beta=1.5"], "loop.ema_beta must be below 1"),
    "misspelt key": (["train", SMALL, "optim.lrr=0.1"], "unknown config key 'optim.lrr'; did you mean optim.lr"),
    "misspelt flag": (["train", SMALL, "--batch-sise", "3"], "unknown flag --batch-sise; did you mean --batch-size"),
    "flag without value": (["train", SMALL, "--lr"], "flag --lr needs a value"),
    "not key=value": (["train", SMALL, "nonsense"], "is not key=value"),
    "job setting": (["train", SMALL, "job.base_size=60"], "must be positive multiples of 16"),
    "missing config file": (["train", "jobs/mshnet/nope.yaml"], "config file 'jobs/mshnet/nope.yaml' not found"),
    "unknown subcommand": (["trian", SMALL], "invalid choice: 'trian'"),
    "train without config": (["train"], "the following arguments are required: config"),
    "test without weights": (["test", SMALL], "test mode needs weights"),
    "best of a run that never ended": (
        ["test", SMALL, "--checkpoint", "best", "run.storage_path=/tmp/raytpu-no-runs", "run.name=never"],
        "--checkpoint best: the run /tmp/raytpu-no-runs/never has no summary.json",
    ),
    "runs of a folder without runs": (["runs", "/tmp/raytpu-no-runs"], "holds no run (no config.yaml) and no runs"),
    "synth without --out": (["data", "synth", "mshnet"], "data synth needs --out DIR"),
    "synth unknown option": (["data", "synth", "mshnet", "--out", "/tmp/x", "--bogus", "3"], "unknown option --bogus"),
    "unknown search domain": (["tune", SMALL, "--search", "optim.lr=normal(0,1)"], "unknown domain 'normal'"),
    "negative concurrency": (
        ["tune", SMALL, "--search", "optim.lr=choice(0.1)", "--max-concurrent", "-1"],
        "tune.max_concurrent must be at least 0",
    ),
    "nothing listens at the address": (["train", SMALL, "--address", "127.0.0.1:1"], "no Ray cluster answers at"),
    "dashboard address for train": (["train", SMALL, "--address", "http://127.0.0.1:8265"], "dashboard address"),
    "storage URI of another kind": (
        ["train", SMALL, "run.storage_path=hdfs://nn/runs"],
        "use a local folder, gs://bucket/prefix or s3://bucket/prefix",
    ),
    "a TrainingArguments flag's value": (
        ["train", SMALL, "--learning_rate", "fast"],
        "--learning_rate fast: optim.lr must be a number (float), got 'fast'",
    ),
    "a seed flag's value": (["train", SMALL, "--epochs=-2"], "--epochs=-2: loop.epochs must be at least 1, got -2"),
    "misspelt Transformers field": (
        ["train", LM, "job.model_config.hiden_size=64"],
        "job.model_config.hiden_size is not a field of Transformers' llama config; did you mean hidden_size",
    ),
    "misspelt field in --config_overrides": (
        ["train", LM, "--config_overrides", "hiden_size=64,num_hidden_layers=2"],
        "--config_overrides hiden_size=64,num_hidden_layers=2: job.model_config.hiden_size is not a field",
    ),
    "mistyped Transformers field": (
        ["train", LM, "job.model_config.num_hidden_layers=two"],
        "job.model_config.num_hidden_layers must be int (as Transformers' LlamaConfig types it), got 'two'",
    ),
    "unknown attention kernel": (
        ["train", LM, "--attn_implementation", "flash"],
        "job.attn_implementation='flash' is not one of causal, sdpa, eager, ",
    ),
    "storage path that cannot be made": (
        ["train", SMALL, "run.storage_path=/proc/raytpu-results"],
        "run.storage_path=/proc/raytpu-results: cannot create or write this folder",
    ),
    "output dir that cannot be made": (
        ["train", SMALL, "--output_dir", "/proc/raytpu-results"],
        "--output_dir /proc/raytpu-results: run.storage_path=/proc/raytpu-results: cannot create or write",
    ),
    "a model that cannot fit the device": (
        ["train", SMALL, "--local", "scaling.device_memory_gb=0.01"],
        "more than 90% of the 0.01 GB of a device (scaling.device_memory_gb): shard the model over the workers",
    ),
    "a tracking server that does not answer": (
        ["train", SMALL, "--report_to", "mlflow", "logging.mlflow_tracking_uri=http://127.0.0.1:9"],
        "the MLflow tracking server at http://127.0.0.1:9 does not answer",
    ),
    "credentials in the storage URI": (
        ["submit", SMALL, "--output_dir", "s3://b/runs?secret_key=x", "--address", "http://127.0.0.1:8265"],
        "carries secret_key: credentials never go into a path",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mistakes_in_the_command_or_config(world, capsys, name):
    argv, expected = CASES[name]
    before = snapshot(world["earlier"])
    code = cli.main(with_overrides(argv, common(world)))
    captured = capsys.readouterr()
    assert_one_error_line(code, captured.out, captured.err, expected)
    assert snapshot(world["earlier"]) == before


def file_cases(world) -> dict[str, tuple[list[str], str]]:
    base, junk = world["base"], world["junk"]
    return {
        "yaml syntax error": (["train", str(base / "broken.yaml")], f"{base / 'broken.yaml'}:4:1: YAML syntax error"),
        "data path is a file": (["train", SMALL, f"data.path={junk}"], "is not a folder"),
        "batch larger than the train split": (
            ["train", SMALL, "data.global_batch_size=32"],
            "has 19 samples, fewer than one step of data.global_batch_size=32",
        ),
        "corrupt first image": (["train", SMALL, f"data.path={world['corrupt']}"], "cannot read this image"),
        "missing list file": (["train", SMALL, f"data.path={base / 'no-list'}"], "trainval.txt is missing"),
        "junk checkpoint": (["test", SMALL, "--checkpoint", str(junk)], "neither a checkpoint directory nor a weights"),
        "folder that is no checkpoint": (["test", SMALL, "--checkpoint", str(base)], "is not a raytpu checkpoint"),
        "storage path is a file": (["train", SMALL, f"run.storage_path={junk}"], "run.storage_path"),
        "config file not UTF-8": (
            ["train", str(base / "latin1.yaml")],
            f"config file {base / 'latin1.yaml'} is not UTF-8 text (byte 0xff at position 22): save it as UTF-8",
        ),
        "a file's value": (["train", str(base / "fast.yaml")], f"{base / 'fast.yaml'}:3: optim.lr must be a number"),
        "a file's misspelt key": (
            ["train", str(base / "misspelt.yaml")],
            f"{base / 'misspelt.yaml'}:4: unknown config key 'loop.epoch'; did you mean loop.epochs",
        ),
        "corrupt statistics file": (
            ["train", str(ROOT / "jobs/cdeit/small.yaml"), f"data.path={base / 'cdeit'}", "data.global_batch_size=2"],
            "mean.pth: not a statistics tensor",
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        "yaml syntax error",
        "data path is a file",
        "batch larger than the train split",
        "corrupt first image",
        "missing list file",
        "junk checkpoint",
        "folder that is no checkpoint",
        "storage path is a file",
        "corrupt statistics file",
        "config file not UTF-8",
        "a file's value",
        "a file's misspelt key",
    ],
)
def test_mistakes_in_files_and_paths(world, capsys, name):
    argv, expected = file_cases(world)[name]
    before = snapshot(world["earlier"])
    overrides = [o for o in common(world) if not any(o.split("=")[0] + "=" in a for a in argv)]
    code = cli.main(with_overrides(argv, overrides))
    captured = capsys.readouterr()
    assert_one_error_line(code, captured.out, captured.err, expected)
    assert snapshot(world["earlier"]) == before


@pytest.fixture(scope="module")
def guarded(stores):
    """An S3 server that checks credentials, with a bucket whose reader may not write."""
    from tests.stores import GuardedS3

    server = GuardedS3()
    yield server
    server.stop()


@pytest.mark.parametrize("case", ["no such bucket", "unknown keys", "a refused write", "no answer", "no gcs bucket"])
def test_bad_storage_is_one_line_before_anything_starts(world, guarded, capsys, monkeypatch, case):
    """Each a real server's answer (or silence), probed from a subprocess with a time limit: one line
    naming the URI and the fix, exit 2, within 30 s, before Ray starts or a file is written."""
    storage, expected = {
        "no such bucket": ("s3://no-such-bucket/runs", "the bucket 'no-such-bucket' does not exist: create it"),
        "unknown keys": ("s3://guarded/runs", "no valid credentials: for gs:// the VM's service account"),
        "a refused write": ("s3://guarded/runs", "the credentials may not write there: grant this node's account"),
        "no answer": ("s3://guarded/runs", "the store does not answer: check AWS_ENDPOINT_URL"),
        "no gcs bucket": ("gs://no-such-bucket/runs", "the bucket 'no-such-bucket' does not exist"),
    }[case]
    if case in ("unknown keys", "a refused write", "no answer"):  # else the session's servers
        monkeypatch.setenv("AWS_ENDPOINT_URL", guarded.endpoint if case != "no answer" else "http://127.0.0.1:1")
    if case == "unknown keys":  # not none at all: the AWS SDK then asks the EC2 metadata service, whose
        # silence here ends in an error or, on a busy machine, in an unsigned request refused as a write
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "unknown")
    if case == "a refused write":
        for name, value in guarded.reader.items():
            monkeypatch.setenv(name, value)
    before = snapshot(world["earlier"])
    code = cli.main(["train", SMALL, *common(world), f"run.storage_path={storage}"])
    captured = capsys.readouterr()
    assert_one_error_line(code, captured.out, captured.err, f"run.storage_path={storage}: {expected}")
    assert snapshot(world["earlier"]) == before


@pytest.mark.integration
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["scaling.runtime=cuda"], "needs 2 CPU, 2 GPU but the cluster has 2 CPU"),
        (["scaling.num_workers=4", "data.global_batch_size=16"], "needs 4 CPU but the cluster has 2 CPU"),
        (["scaling.cpus_per_worker=3"], "no node has 3 CPU: use a smaller scaling.cpus_per_worker (at most 2"),
        (["runtime=xla", "xla.spmd=true", "xla.mesh.fsdp=-1"], "over 2 workers of the CPU PJRT device"),
    ],
    ids=["no GPU", "too many workers", "too many CPUs per worker", "FSDPv2 over CPU workers"],
)
def test_resources_the_cluster_does_not_have(world, ray_session, capsys, overrides, expected):
    before = snapshot(world["earlier"])
    code = cli.main(["train", SMALL, *common(world), *overrides])
    captured = capsys.readouterr()
    assert_one_error_line(code, captured.out, captured.err, expected)
    assert snapshot(world["earlier"]) == before


@pytest.mark.parametrize(
    ("overrides", "accelerators"),
    [
        (["xla.mesh.fsdp=-1", "scaling.num_workers=2"], {"TPU": 8, "GPU": 0}),
        (["xla.mesh.fsdp=-1", "scaling.num_workers=2"], {"TPU": 0, "GPU": 2}),
        (["xla.mesh.fsdp=-1", "scaling.num_workers=1"], {"TPU": 0, "GPU": 0}),
        (["xla.mesh.fsdp=1", "scaling.num_workers=2"], {"TPU": 0, "GPU": 0}),
    ],
    ids=["TPU hosts", "GPUs", "one CPU worker", "data-parallel CPU workers"],
)
def test_fsdp_over_several_workers_is_refused_only_without_xla_collectives(overrides, accelerators):
    from raytpu.runtime.kinds import kind_of
    from raytpu.runtime.placement import ClusterOffer

    cfg, _ = load_config(SMALL, ["runtime=xla", "xla.spmd=true", *overrides])
    node = {"CPU": 8.0, **{name: float(count) for name, count in accelerators.items()}}
    kind_of("xla").check_workers(cfg, ClusterOffer(nodes=(node,), available=node))


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["trian", SMALL], "invalid choice"),
        (["train", SMALL, "loop.epochs=-3"], "loop.epochs must be at least 1"),
        (["train", SMALL, "--address", "127.0.0.1:1"], "no Ray cluster answers at 127.0.0.1:1"),
        (["test", SMALL, "--checkpoint", "JUNK"], "neither a checkpoint directory nor a weights file"),
        (["train", SMALL, "scaling.runtime=cuda"], "the cluster has no GPU"),
    ],
    ids=["unknown subcommand", "negative epochs", "unreachable address", "junk checkpoint", "no GPU"],
)
def test_the_raytpu_executable(world, argv, expected):
    """As typed in a shell (the last one starts its own local Ray instance)."""
    argv = [str(world["junk"]) if a == "JUNK" else a for a in argv]
    before = snapshot(world["earlier"])
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [RAYTPU, *with_overrides(argv, common(world))], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert_one_error_line(done.returncode, done.stdout, done.stderr, expected)
    assert snapshot(world["earlier"]) == before
