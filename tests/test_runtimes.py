"""What each runtime means, asked of its description (``raytpu.runtime.kinds``): no module outside
``runtime/`` compares a runtime's name; a runtime of the tests' own, added as one module, trains
on 2 Ray workers through the normal entry; TorchTPU's plan, Ray request, backend and refusals on a
machine without TPU chips."""

from __future__ import annotations

import ast
import os
import sys

import pytest
import yaml

from raytpu import cli
from raytpu.cluster.capacity import node_types_of_config
from raytpu.config import ConfigError, load_config
from raytpu.config.plan import Facts, make_plan
from raytpu.driver.ray_trainer import scaling_kwargs, worker_bundles
from raytpu.records import devices
from raytpu.runtime import kinds
from raytpu.runtime.kinds import kind_of
from raytpu.runtime.placement import ClusterOffer, place
from raytpu.storage.run_folder import RunFolder
from tests.conftest import ROOT

PACKAGE = ROOT / "raytpu"
SMALL = str(ROOT / "jobs/mshnet/small.yaml")
TOY = ["job.name=tests.toy_job", "data.global_batch_size=8", "logging.progress_bar=false"]


def test_no_module_outside_runtime_compares_a_runtimes_name():
    """config/, driver/, worker/ and the rest ask the runtime's description; none compares a
    runtime's name (``runtime == "xla"``, ``cfg.scaling.runtime in ("cpu", ...)``)."""
    names = {kind.name for kind in kinds.registered().values()}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "runtime":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            text = ast.unparse(node)
            constants = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            if constants & names and ("runtime" in text or "device" in text):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert not found, found


def test_the_runtimes_are_described_in_runtime_alone():
    assert set(kinds.registered()) == {"cpu", "cuda", "xla", "torch_tpu"}
    assert {kind.accelerator for kind in kinds.registered().values()} == {"", "GPU", "TPU"}
    with pytest.raises(ConfigError, match="scaling.runtime='tpu' is not one of auto, cpu, cuda, xla, torch_tpu"):
        kind_of("tpu")
    with pytest.raises(ConfigError, match="module tests.toy_job has no RUNTIME named 'tests.toy_job'"):
        kind_of("tests.toy_job")


@pytest.mark.integration
def test_a_runtime_of_its_own_trains_on_two_ray_workers(ray_session, tmp_path):
    """``tests/own_runtime.py`` (a variant of cpu), named by its module path: the plan and the
    workers' runtime are its own, through ``raytpu train`` on 2 Ray workers."""
    config = tmp_path / "toy.yaml"
    config.write_text(f"job: {{name: tests.toy_job}}\ndata: {{path: {tmp_path}}}\n")
    argv = ["train", str(config), *TOY, "scaling.num_workers=2", "scaling.runtime=tests.own_runtime",
            "loop.epochs=1", f"run.storage_path={tmp_path}", "run.name=own"]  # fmt: skip
    assert cli.main(argv) == 0
    assert devices.read(RunFolder(tmp_path / "own"))["runtime"] == "tests.own_runtime"


# ------------------------------------------------------------------ TorchTPU
def cluster_yaml() -> ClusterOffer:
    types = node_types_of_config(yaml.safe_load((ROOT / "cluster.yaml").read_text()))
    return ClusterOffer(nodes=({"CPU": 8.0},), available={"CPU": 8.0}, node_types=types, node_types_from="test")


def test_torch_tpu_plans_one_worker_a_chip_over_tpu_dist_on_a_tpu_cluster():
    cfg, _ = load_config(SMALL, ["scaling.runtime=torch_tpu", "scaling.num_workers=4", "data.global_batch_size=8"])
    plan = make_plan(cfg, Facts(mode="train", offer=cluster_yaml()))
    assert (plan.config.scaling.runtime, plan.config.scaling.precision, plan.config.loop.compile) == (
        "torch_tpu",
        "bf16",
        "true",
    )
    assert "scaling.precision auto -> bf16: TPUs compute in bf16" in plan.notes
    kwargs = scaling_kwargs(plan.config)
    assert kwargs["use_tpu"] and worker_bundles(plan.config) == [{"CPU": 1.0, "TPU": 1.0}] * 4
    config = kind_of("torch_tpu").torch_config()
    assert config.backend == "tpu_dist"
    with pytest.raises(RuntimeError, match="this worker has no torch_tpu"):  # TorchTPU loaded before tpu_dist
        config.before()
    assert kind_of("torch_tpu").data_parallel_replicas(plan.config) == 4  # a chip each
    assert kind_of("torch_tpu").sharded_checkpoints_differ  # FSDP2's DCP shards, as on cuda


def test_auto_picks_torch_tpu_where_it_is_installed_and_torch_xla_is_not(monkeypatch):
    from raytpu.runtime import torch_tpu

    assert place("auto", 1, "spmd", False, cluster_yaml()).runtime == "xla"  # torch_xla is here
    monkeypatch.setattr(torch_tpu, "installed", lambda: True)
    placement = place("auto", 1, "spmd", False, cluster_yaml())
    assert placement.runtime == "torch_tpu" and "torch_tpu is installed (torch_xla is not)" in placement.why


def test_torch_tpu_without_tpu_chips_is_one_line(monkeypatch, capsys, tmp_path):
    """TorchTPU has no CPU mode: asked for on a cluster that can start no TPU, or on this machine
    (no chips), one line; on a TPU VM without it installed, one line naming the extra."""
    no_tpu = ClusterOffer(nodes=({"CPU": 8.0, "GPU": 1.0},), available={"CPU": 8.0})
    with pytest.raises(ValueError, match="scaling.runtime=torch_tpu but the cluster has no TPU .*no CPU mode"):
        place("torch_tpu", 1, "spmd", False, no_tpu)
    argv = ["train", SMALL, "--local", "scaling.runtime=torch_tpu", "scaling.num_workers=1",
            f"run.storage_path={tmp_path}"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "scaling.runtime=torch_tpu but this machine has no TPU chips: TorchTPU has no CPU mode" in err
    assert len(err.strip().splitlines()) == 1
    tpu_vm = ClusterOffer(nodes=({"CPU": 8.0, "TPU": 4.0},), available={"CPU": 8.0, "TPU": 4.0}, this_machine=True)
    cfg, _ = load_config(SMALL, ["scaling.runtime=torch_tpu", "scaling.num_workers=1"])
    with pytest.raises(ConfigError, match=r"needs TorchTPU: pip install -e '.*\[torch_tpu\]'"):
        kind_of("torch_tpu").check_local(cfg, tpu_vm)


def test_doctor_reports_torch_tpu_and_auto_there():
    from raytpu.driver import doctor

    assert doctor.auto_choice(4, False, {"available": False}, torch_tpu_installed=True)["runtime"] == "torch_tpu"
    assert doctor.auto_choice(4, True, {"available": False}, torch_tpu_installed=True)["runtime"] == "xla"
    warning = doctor.check_torch_tpu("0.2.0", tpu_chips=0)
    assert warning is not None and "no CPU mode" in warning["message"] and not warning["blocking"]
    assert doctor.check_torch_tpu("0.2.0", tpu_chips=8) is None


def test_raytpu_keeps_torch_tpus_autoload_off_in_its_processes():
    """``import torch`` with TorchTPU installed loads its TPU backend (seconds, log lines) unless
    ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``: raytpu sets it for its driver and passes it to its workers."""
    import subprocess

    code = "import os, raytpu; print(os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'])"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert done.stdout.strip() == "0", done.stderr
