"""MSHNet on the XLA CPU PJRT device, each configuration in its own process."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from raytpu.jobs.mshnet.synth import synthesize
from tests.conftest import XlaProbe, run_python

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """MSHNet's IRSTD-format set, its Ray Data tables, and a CDEIT set."""
    from raytpu.config import load_config
    from raytpu.jobs.cdeit.synth import synthesize as synthesize_eit
    from raytpu.storage import tables as ingest

    root = tmp_path_factory.mktemp("xla")
    synthesize(root / "mshnet", n=24, size=32, seed=0)
    _, job = load_config(None, ["job.name=mshnet"])
    ingest.prepare(job, root / "mshnet", str(root / "pq"))
    synthesize_eit(root / "cdeit", n_train=16, n_valid=4, n_test=4, size=32, seed=0)
    return root


def mshnet(root, *overrides: str) -> list[str]:
    """MSHNet cut down for compile time (which grows with the image size, the widths and the depth):
    16x16 crops, one block a stage, narrow; the same layers, heads, loss and optimizer."""
    return [
        "job.name=mshnet",
        f"data.path={root}",
        "job.base_size=16",
        "job.crop_size=16",
        "job.blocks=1",
        "job.widths=[4,8,8,16,16]",
        "job.warm_epoch=-1",
        "data.global_batch_size=4",
        "loop.max_steps=6",
        "loop.log_every=1",
        *overrides,
    ]


#: CDEIT small cut down for compile time: the same kinds of blocks (windowed attention at the
#: ends, two down / up stages, adaLN), one of each
CDEIT_SHALLOW = ["job.hidden_size=32", "job.num_heads=4", "job.scales=2", "job.stage_depth=1", "job.window_depth=1"]


def cdeit(root) -> list[str]:
    return [
        "job.name=cdeit",
        f"data.path={root}",
        "job.image_size=32",
        *CDEIT_SHALLOW,
        "data.global_batch_size=8",
        "loop.max_steps=6",
        "loop.log_every=1",
        "xla.spmd=true",
        "optim.name=adam",
        "loop.clip_grad_norm=1.0",
        "loop.ema_beta=0.995",
        "loop.ema_every=4",
        "loop.ema_update_after=2",  # checked steps 3-5: no update, then a ramped weight (0.63)
    ]


#: the 4-device runs, in one SPMD process: MSHNet data-parallel (torch and Ray Data ingest: the
#: same step graph, compiled once), MSHNet FSDPv2, and CDEIT data-parallel with EMA
SPMD_RUNS = ["dp4", "dp4-ray", "fsdp4", "cdeit"]
MESHES = {"single": 1, "dp4": 4, "fsdp4": 4}
#: relative distance allowed between a sharded run's losses and the single device's
#: (same global batch, same seed): float reduction order differs across shards, and
#: MSHNet's Adagrad at lr 0.05 amplifies it over 6 steps to about 1%
LOSS_RTOL = 3e-2


#: the single-device run traces these steps with torch_xla's profiler (after the warm-up steps: the
#: compile check shows that tracing them compiles nothing)
PROFILED = (4, 5)


@pytest.fixture(scope="module")
def runs(data, ray_session):
    """Each run's report: the single-device probe and the 4-device one side by side; a run with
    ``data.loader=ray`` reads through the session's Ray instance."""
    single = XlaProbe(1, mshnet(data / "mshnet", "xla.spmd=false", f"loop.profile_steps=[{PROFILED[0]},{PROFILED[1]}]"))
    spmd = XlaProbe(
        4,
        mshnet(data / "mshnet", "xla.spmd=true"),
        mshnet(data / "pq", "xla.spmd=true", "data.loader=ray"),
        mshnet(data / "mshnet", "xla.spmd=true", "sharding.mesh.data=1", "sharding.mesh.fsdp=4"),
        cdeit(data / "cdeit"),
        env={"RAY_ADDRESS": ray_session.get_runtime_context().gcs_address},
    )
    return {"single": single.reports()[0], **dict(zip(SPMD_RUNS, spmd.reports()))}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_training_step_compiles_once_and_has_no_cpu_fallback(runs, mesh):
    report = runs[mesh]
    assert report["devices"] == MESHES[mesh]
    assert report["steps_checked"] == 3
    assert report["compiles_after_warmup"] == 0, report
    assert report["fallbacks_after_warmup"] == [], report
    assert len(report["losses"]) == 6 and all(loss == loss for loss in report["losses"])  # read back by closures
    assert report["input_sharding"].startswith(INPUT_SHARDING[mesh]), report
    assert mesh != "single" or report["input_sharding"] == "", report


#: how the step receives each batch tensor: whole on one device (no spec), or split 4 ways along the batch axis
INPUT_SHARDING = {"single": "", "dp4": "{devices=[4,1,1,1]", "fsdp4": "{devices=[4,1,1,1]"}


@pytest.mark.parametrize("mesh", ["dp4", "fsdp4"])
def test_sharded_runs_follow_the_single_device_loss_trajectory(runs, mesh):
    single, sharded = runs["single"]["losses"], runs[mesh]["losses"]
    assert sharded == pytest.approx(single, rel=LOSS_RTOL), (single, sharded)
    assert sharded != pytest.approx(single[::-1], rel=LOSS_RTOL)  # the trajectory is not flat: the check bites


def test_ray_data_batches_feed_the_sharded_step_without_recompiles(runs):
    """data.loader=ray on XLA: the worker's Ray Data batches go through MpDeviceLoader,
    sharded over the 4-device mesh's batch axis, into the same compiled step."""
    report = runs["dp4-ray"]
    assert report["devices"] == 4 and report["steps_checked"] == 3
    assert report["input_sharding"] == runs["dp4"]["input_sharding"]  # as the torch path shards it
    assert report["compiles_after_warmup"] == 0, report
    assert report["fallbacks_after_warmup"] == [], report


def test_cdeit_spmd_training_step_compiles_once(runs):
    report = runs["cdeit"]
    assert report["devices"] == 4 and report["steps_checked"] == 3
    assert report["compiles_after_warmup"] == 0, report
    assert report["fallbacks_after_warmup"] == [], report


def test_recompile_guard_fails_a_strict_run(tmp_path):
    args = [
        "-m",
        "tests.xla_probe",
        "1",
        "job.name=tests.toy_job",
        "job.vary_shape=true",
        "loop.max_steps=6",
        "xla.strict_recompile=true",
    ]
    done = run_python(args, env={"PJRT_DEVICE": "CPU"})
    assert done.returncode != 0
    assert "recompiled the XLA graph" in done.stderr and "PT_XLA_DEBUG_LEVEL=2" in done.stderr


def test_cdeit_sampler_compiles_one_graph_for_all_test_batches(tmp_path):
    """10 test samples in batches of 4: three sampler calls (the last one padded to 4)
    share one compiled graph; a second test pass compiles nothing."""
    from raytpu.jobs.cdeit.synth import synthesize as synthesize_eit

    synthesize_eit(tmp_path / "cdeit", n_train=4, n_valid=2, n_test=10, size=32, seed=0)
    args = ["-m", "tests.xla_sampler_probe", str(tmp_path / "cdeit"), str(tmp_path / "run"), "4", *CDEIT_SHALLOW]
    done = run_python(args, env={"PJRT_DEVICE": "CPU"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["compiles_per_pass"] == [1, 0], report
    assert report["rmse"] == report["rmse"]


def test_a_profile_window_on_the_xla_cpu_device_writes_a_trace_tensorboard_and_perfetto_open(runs):
    """torch_xla's profiler traces the CPU PJRT device: an XSpace for TensorBoard's profile plugin and
    a Chrome trace for Perfetto, under the run's profile/, with the host-side marks of exactly the
    chosen steps; the goodput's compilation is torch_xla's own compile time."""
    run_dir = Path(runs["single"]["run_dir"])
    files = [p for p in (run_dir / "profile" / "plugins" / "profile").rglob("*") if p.is_file()]
    assert {p.name.split(".", 1)[1] for p in files} == {"xplane.pb", "trace.json.gz"}, files
    trace = read_gzipped_json(next(p for p in files if p.name.endswith(".trace.json.gz")))
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert {name for name in names if name.startswith("raytpu step ")} == {f"raytpu step {s}" for s in (4, 5)}
    goodput = json.loads((run_dir / "goodput.json").read_text())
    # MSHNet's step graphs compiled in this run: torch_xla's compile time is counted (how long it is,
    # is the machine's)
    assert goodput["categories"]["compilation"] > 0, goodput


def read_gzipped_json(path: Path) -> dict:
    with gzip.open(path) as handle:
        return json.load(handle)
