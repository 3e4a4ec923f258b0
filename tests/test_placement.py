"""Where workers go, decided from what a cluster has up and what its autoscaler can start: the
runtime ``auto`` picks, the TPU or GPU each worker asks for, and whether a run fits now, once nodes
start, or never, with advice that works. Pure functions, fed with ``cluster.yaml``'s own node types
(read as the driver reads the head's autoscaling config) and with Ray's cluster config record."""

from __future__ import annotations

import re

import pytest
import yaml

from raytpu.cluster.capacity import node_types_of_config, node_types_of_record
from raytpu.config import load_config, with_values
from raytpu.config.plan import resolve_config
from raytpu.driver.ray_trainer import worker_bundles
from raytpu.errors import ConfigError
from raytpu.runtime.kinds import kind_of
from raytpu.runtime.placement import ClusterOffer, NodeType, choose_runtime, judge_fit, place
from tests.conftest import ROOT

SMALL = str(ROOT / "jobs/mshnet/small.yaml")
HEAD = {"CPU": 0.0}  # cluster.yaml's head: no CPU for workers or Ray Data tasks


def cluster_yaml_types(*keep: str) -> tuple[NodeType, ...]:
    types = node_types_of_config(yaml.safe_load((ROOT / "cluster.yaml").read_text()))
    return tuple(t for t in types if not keep or t.name in keep)


def autoscaling(*keep: str) -> ClusterOffer:
    """A cluster from cluster.yaml as a job finds it: the head up, every other node type startable."""
    return ClusterOffer(nodes=(HEAD,), available=HEAD, node_types=cluster_yaml_types(*keep), node_types_from="test")


def placed_bundles(overrides: list[str], offer: ClusterOffer) -> tuple[list[dict[str, float]], str]:
    cfg, _ = load_config(SMALL, ["scaling.num_workers=1", *overrides])
    scaling = cfg.scaling
    placement = place(
        scaling.runtime, scaling.num_workers, scaling.tpu.layout, bool(scaling.tpu.accelerator_type), offer
    )
    resolved = resolve_config(cfg, placement.runtime, "fp32", placement)
    return worker_bundles(resolved), placement.runtime


def test_cluster_yaml_node_types_are_read_with_their_hosts() -> None:
    types = {t.name: t for t in cluster_yaml_types()}
    assert set(types) == {"tpu_v5e_8", "tpu_v5e_16_slice", "gpu_t4", "gpu_t4_spot"}
    assert (types["tpu_v5e_8"].resources["TPU"], types["tpu_v5e_8"].hosts) == (8, 1)
    assert (types["tpu_v5e_16_slice"].resources["TPU"], types["tpu_v5e_16_slice"].hosts) == (4, 4)
    assert types["gpu_t4"].resources["GPU"] == 1 and types["gpu_t4"].max_count == 2
    assert types["gpu_t4_spot"].max_count == 4  # the spot GPUs of an elastic run


def test_auto_looks_at_the_node_types_the_autoscaler_can_start() -> None:
    runtime, why = choose_runtime("auto", autoscaling())
    assert runtime == "xla" and "tpu_v5e_8 (8 TPU)" in why and "none is up yet" in why
    runtime, why = choose_runtime("auto", autoscaling("gpu_t4"))
    assert runtime == "cuda" and "gpu_t4 (1 GPU)" in why
    runtime, why = choose_runtime("auto", ClusterOffer(nodes=(HEAD,), node_types=(NodeType("cpu", {"CPU": 8}, 3),)))
    assert runtime == "cpu" and "nor" not in why and "node types its autoscaler can start" in why
    assert choose_runtime("auto", ClusterOffer(nodes=({"CPU": 2.0},)))[0] == "cpu"
    assert choose_runtime("cuda", autoscaling()) == ("cuda", "")


def test_rays_cluster_config_record_gives_the_same_choice() -> None:
    from ray.core.generated import autoscaler_pb2

    record = autoscaler_pb2.ClusterConfig()
    for node_type in cluster_yaml_types("tpu_v5e_8", "gpu_t4"):
        group = record.node_group_configs.add(name=node_type.name, max_count=node_type.max_count)
        group.resources.update({k: int(v) for k, v in node_type.resources.items()})
    types = node_types_of_record(autoscaler_pb2.ClusterConfig.FromString(record.SerializeToString()))
    assert [t.name for t in types] == ["tpu_v5e_8", "gpu_t4"]
    assert choose_runtime("auto", ClusterOffer(nodes=(HEAD,), node_types=types))[0] == "xla"


def test_an_xla_worker_asks_for_a_tpu_host_or_chip_so_the_autoscaler_starts_one() -> None:
    offer = autoscaling()
    bundles, runtime = placed_bundles([], offer)
    assert runtime == "xla" and bundles == [{"CPU": 1.0, "TPU": 8.0}]
    assert judge_fit(bundles, offer, "1 xla worker(s)").verdict == "later"
    bundles, _ = placed_bundles(["runtime=xla", "scaling.tpu.layout=multiprocess", "scaling.num_workers=4"], offer)
    assert bundles == [{"CPU": 1.0, "TPU": 1.0}] * 4  # one chip each, of a v5e 2x2
    # four hosts: the slice's 4-chip hosts, the only type with four of them; Ray Train reserves
    # several TPU workers as a slice, which the plan names (a v5e 4x4: 4 hosts of 4 chips)
    cfg, _ = load_config(SMALL, ["runtime=xla", "scaling.num_workers=4", "data.global_batch_size=8"])
    placement = place("auto", 4, "spmd", False, offer)
    assert placement.tpu_slice == ("TPU-V5LITEPOD", "4x4")
    bundles = worker_bundles(resolve_config(cfg, "xla", "bf16", placement))
    assert bundles == [{"CPU": 1.0, "TPU": 4.0}] * 4 and judge_fit(bundles, offer, "4").verdict == "later"
    assert place("auto", 8, "multiprocess", False, offer).tpu_slice == ("TPU-V5LITEPOD", "2x4")
    unnamed = ClusterOffer(nodes=(HEAD,), node_types=(NodeType("tpu", {"CPU": 8, "TPU": 4}, 2),))
    with pytest.raises(ValueError, match="name it with scaling.tpu.accelerator_type and scaling.tpu.topology"):
        place("auto", 2, "spmd", False, unnamed)
    # a named slice sets each worker's share itself
    slice_keys = ["runtime=xla", "scaling.tpu.accelerator_type=TPU-V5LITEPOD", "scaling.tpu.topology=4x4"]
    bundles, _ = placed_bundles([*slice_keys, "scaling.num_workers=4"], offer)
    assert bundles == [{"CPU": 1.0, "TPU": 4.0}] * 4
    # no TPU anywhere: on this machine, XLA on the CPU PJRT device, as the tests run it; on a
    # cluster the user asked for a TPU: one line, unless PJRT_DEVICE=CPU on the driver asks for the CPU
    here = ClusterOffer(nodes=({"CPU": 2.0},), available={"CPU": 2.0}, this_machine=True)
    bundles, _ = placed_bundles(["runtime=xla"], here)
    assert bundles == [{"CPU": 1.0}] and judge_fit(bundles, here, "x").verdict == "now"
    cluster = ClusterOffer(nodes=({"CPU": 2.0},), available={"CPU": 2.0}, node_types=cluster_yaml_types("gpu_t4"))
    with pytest.raises(ValueError, match="scaling.runtime=xla but the cluster has no TPU and its autoscaler can "
                                         "start none .*gpu_t4.*export PJRT_DEVICE=CPU"):  # fmt: skip
        place("xla", 1, "spmd", False, cluster)
    assert "CPU PJRT device" in place("xla", 1, "spmd", False, cluster, xla_on_cpu=True).note


def test_a_cuda_worker_asks_for_its_gpu_and_the_head_runs_none() -> None:
    offer = autoscaling("gpu_t4")
    bundles, runtime = placed_bundles(["scaling.num_workers=2", "data.global_batch_size=8"], offer)
    assert runtime == "cuda" and bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert judge_fit(bundles, offer, "2 cuda worker(s)").verdict == "later"
    cpu_bundles, _ = placed_bundles(["runtime=cpu"], ClusterOffer(nodes=(HEAD,), node_types=()))
    assert judge_fit(cpu_bundles, ClusterOffer(nodes=(HEAD,)), "1 cpu worker(s)").verdict == "never"


def test_a_request_no_node_type_can_satisfy_names_the_node_types() -> None:
    offer = autoscaling()
    bundles = [{"CPU": 1.0, "GPU": 8.0}]
    fit = judge_fit(bundles, offer, "1 cuda worker(s)")
    assert fit.verdict == "never"
    assert "gpu_t4 (8 CPU, 1 GPU; at most 2)" in fit.message and "tpu_v5e_16_slice (4 hosts of" in fit.message
    assert "no node has 8 GPU: ask for at most 1 per worker" in fit.message
    three_slices = [  # the v5e-8 host holds two, the slice's 4 hosts one each
        {"CPU": 1.0, "TPU": 4.0}
    ] * 12
    fit = judge_fit(three_slices, offer, "12 xla worker(s)")
    assert fit.verdict == "never" and "set scaling.num_workers=6" in fit.message


def test_the_quick_start_on_a_one_gpu_machine_runs_one_gpu_worker() -> None:
    machine = {"CPU": 8.0, "GPU": 1.0}
    offer = ClusterOffer(nodes=(machine,), available=machine, this_machine=True)
    placement = place("auto", 2, "spmd", False, offer)
    assert (placement.runtime, placement.num_workers) == ("cuda", 1)
    assert "running 1 cuda worker(s)" in placement.note and "scaling.runtime=cpu runs 2 CPU workers" in placement.note
    bundles, _ = placed_bundles(["scaling.num_workers=2"], offer)
    assert bundles == [{"CPU": 1.0, "GPU": 1.0}] and judge_fit(bundles, offer, "1").verdict == "now"
    # the same machine as one node of a cluster: the autoscaler may add GPUs, nothing is cut
    assert place("auto", 2, "spmd", False, ClusterOffer(nodes=(machine,))).num_workers == 2


@pytest.mark.parametrize(
    ("runtime", "workers", "machine"),
    [("cuda", 2, {"CPU": 8.0, "GPU": 1.0}), ("cuda", 1, {"CPU": 2.0}), ("cpu", 4, {"CPU": 2.0})],
    ids=["2 cuda workers on 1 GPU", "cuda without GPU", "4 workers on 2 CPUs"],
)
def test_every_fix_an_error_names_works(runtime: str, workers: int, machine: dict[str, float]) -> None:
    """Apply the setting the error names (scaling.num_workers=N, scaling.runtime=auto) and place again."""
    offer = ClusterOffer(nodes=(machine,), available=machine)
    overrides = [f"runtime={runtime}", f"scaling.num_workers={workers}", "data.global_batch_size=4"]
    bundles, _ = placed_bundles(overrides, offer)
    fit = judge_fit(bundles, offer, f"{workers} {runtime} worker(s)")
    assert fit.verdict == "never"
    fixes = re.findall(r"(scaling\.\w+=\w+)", fit.message)
    assert fixes, fit.message
    for fix in fixes:
        key = fix.split("=")[0]
        fixed = [o for o in overrides if o.split("=")[0] not in (key, key.removeprefix("scaling."))]
        fixed_bundles, _ = placed_bundles([*fixed, fix], offer)
        assert judge_fit(fixed_bundles, offer, "fixed").verdict == "now", (fix, fit.message)


def test_local_processes_need_a_gpu_each() -> None:
    machine = {"CPU": 8.0, "GPU": 1.0}
    offer = ClusterOffer(nodes=(machine,), available=machine, this_machine=True)

    def check(runtime: str, workers: int, machine: ClusterOffer) -> None:
        placement = place(runtime, workers, "spmd", False, machine)
        cfg, _ = load_config(SMALL, [f"scaling.num_workers={placement.num_workers}"])
        kind_of(placement.runtime).check_local(cfg, machine)

    with pytest.raises(
        ConfigError, match=r"2 cuda workers need 2 GPUs but this machine has 1: set scaling.num_workers=1"
    ):
        check("cuda", 2, offer)
    check("auto", 2, offer)
    laptop = ClusterOffer(nodes=({"CPU": 2.0},), this_machine=True)
    with pytest.raises(ConfigError, match="this machine has no GPU; use scaling.runtime=auto"):
        check("cuda", 1, laptop)


def test_a_bucket_in_data_path_is_read_through_ray_data_or_refused_in_one_line() -> None:
    from raytpu.config.loading import read_buckets_through_ray_data
    from raytpu.driver.preflight import check_local
    from raytpu.job import Job

    cfg, job = load_config(SMALL, ["data.path=gs://b/mshnet-tables"])
    assert cfg.data.loader == "ray"  # mshnet has parquet tables: read through Ray Data
    with pytest.raises(ConfigError, match="--local reads data from this machine's disk: data.path=gs://b/mshnet"):
        check_local(cfg)

    class FolderOnly(Job):
        name = "folder_only"

    folder_only, _ = load_config(SMALL, ["data.path=/data/mshnet"])
    assert folder_only.data.loader == "torch"
    in_bucket = with_values(folder_only, {"data.path": "s3://b/x"})
    with pytest.raises(ConfigError, match="job 'folder_only' reads a folder .*give a folder that every node has"):
        read_buckets_through_ray_data(in_bucket, FolderOnly())


def test_per_device_batches_count_the_chips_a_worker_is_given() -> None:
    """TrainingArguments' per-device batch on a TPU host the autoscaler starts: a device is a chip."""
    cfg, _ = load_config(SMALL, ["scaling.num_workers=1", "--per_device_train_batch_size", "2"])
    placement = place("auto", 1, "spmd", False, autoscaling())
    assert resolve_config(cfg, "xla", "bf16", placement).data.global_batch_size == 2 * 8


def test_ray_train_s_preemption_watcher_only_where_a_node_can_be_drained(monkeypatch) -> None:
    """One node and no autoscaler (raytpu's local instance) has no node to drain: the watcher is left
    out; several nodes, an autoscaler's node types or nodes not known keep it; the user's setting stays."""
    from raytpu.driver import ray_trainer

    monkeypatch.delenv(ray_trainer.PREEMPTION_WATCHER, raising=False)
    monkeypatch.setattr(ray_trainer, "_WATCHER_SET", [False])
    one = ClusterOffer(nodes=({"CPU": 2.0},), available={"CPU": 2.0}, this_machine=True)
    two = ClusterOffer(nodes=({"CPU": 2.0}, {"CPU": 2.0}))
    for offer, watched in ((one, False), (two, True), (autoscaling(), True), (ClusterOffer(), True), (one, False)):
        ray_trainer.watch_preemption(offer)
        assert ("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in ray_trainer.os.environ) == watched, offer
    monkeypatch.setenv(ray_trainer.PREEMPTION_WATCHER, "1")
    monkeypatch.setattr(ray_trainer, "_WATCHER_SET", [False])
    ray_trainer.watch_preemption(one)
    assert ray_trainer.os.environ[ray_trainer.PREEMPTION_WATCHER] == "1"
