"""MSHNet on the XLA CPU PJRT device, each configuration in its own process."""

from __future__ import annotations

import json

import pytest

from jobs.mshnet.synth import synthesize
from tests.conftest import run_python

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def irstd(tmp_path_factory):
    root = tmp_path_factory.mktemp("xla") / "mshnet"
    synthesize(root, n=24, size=32, seed=0)
    return root


def probe(root, env: dict[str, str], *overrides: str) -> dict:
    args = [
        "-m",
        "tests.xla_probe",
        "3",
        "job.name=mshnet",
        f"data.path={root}",
        "job.base_size=32",
        "job.crop_size=32",
        "job.warm_epoch=0",
        "data.global_batch_size=4",
        "loop.max_steps=6",
        "loop.log_every=1",
        *overrides,
    ]
    done = run_python(args, env={"PJRT_DEVICE": "CPU", **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("devices", "spmd"), [(1, "false"), (4, "true")])
def test_training_step_compiles_once_and_has_no_cpu_fallback(irstd, devices, spmd):
    report = probe(irstd, {"CPU_NUM_DEVICES": str(devices)}, f"xla.spmd={spmd}")
    assert report["devices"] == devices
    assert report["steps_checked"] == 3
    assert report["compiles_after_warmup"] == 0, report
    assert report["fallbacks_after_warmup"] == [], report
    assert all(loss == loss for loss in report["losses"])  # finite, read back through step closures


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


def test_cdeit_spmd_training_step_compiles_once(tmp_path):
    from jobs.cdeit.synth import synthesize as synthesize_eit

    synthesize_eit(tmp_path / "cdeit", n_train=16, n_valid=4, n_test=4, size=32, seed=0)
    args = [
        "-m",
        "tests.xla_probe",
        "3",
        "job.name=cdeit",
        f"data.path={tmp_path / 'cdeit'}",
        "job.image_size=32",
        "job.hidden_size=64",
        "data.global_batch_size=8",
        "loop.max_steps=6",
        "loop.log_every=1",
        "xla.spmd=true",
        "optim.name=adam",
        "loop.clip_grad_norm=1.0",
        "loop.ema_beta=0.995",
        "loop.ema_every=4",
    ]
    done = run_python(args, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4 and report["steps_checked"] == 3
    assert report["compiles_after_warmup"] == 0, report
    assert report["fallbacks_after_warmup"] == [], report
