"""TPU slice arithmetic and torch_xla's multi-process PJRT environment (raytpu.runtime.tpu), checked without a TPU."""

from __future__ import annotations

import json

import pytest

from raytpu.runtime.tpu import (
    apply_env,
    check_num_workers,
    parse_pod_type,
    pjrt_env_for_process,
    slice_spec,
    workers_for_layout,
)
from tests.conftest import run_python

# (pod type, Ray accelerator type, topology, hosts, chips per host)
SLICES = [
    ("v5litepod-8", "TPU-V5LITEPOD", "2x4", 1, 8),
    ("v4-8", "TPU-V4", "2x2x1", 1, 4),
    ("v4-16", "TPU-V4", "2x2x2", 2, 4),
    ("v5litepod-16", "TPU-V5LITEPOD", "4x4", 4, 4),
]

V5E8_ADDRESSES = (
    "localhost:8476,localhost:8477,localhost:8478,localhost:8479,"
    "localhost:8480,localhost:8481,localhost:8482,localhost:8483"
)
V4_8_ADDRESSES = "localhost:8476,localhost:8477,localhost:8478,localhost:8479"
V4_16_HOSTS = ["10.0.0.1", "10.0.0.2"]
V4_16_ADDRESSES = (
    "10.0.0.1:8476,10.0.0.1:8477,10.0.0.1:8478,10.0.0.1:8479,10.0.0.2:8476,10.0.0.2:8477,10.0.0.2:8478,10.0.0.2:8479"
)
V5E16_HOSTS = ["10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"]
V5E16_ADDRESSES = (
    "10.1.0.1:8476,10.1.0.1:8477,10.1.0.1:8478,10.1.0.1:8479,"
    "10.1.0.2:8476,10.1.0.2:8477,10.1.0.2:8478,10.1.0.2:8479,"
    "10.1.0.3:8476,10.1.0.3:8477,10.1.0.3:8478,10.1.0.3:8479,"
    "10.1.0.4:8476,10.1.0.4:8477,10.1.0.4:8478,10.1.0.4:8479"
)

# (world rank, local rank, chips per host, host index, hosts, topology) -> the env torch_xla would set
PJRT_CASES = [
    (
        (0, 0, 8, 0, ["10.0.0.9"], None),
        {
            "PJRT_DEVICE": "TPU",
            "PJRT_LOCAL_PROCESS_RANK": "0",
            "PJRT_LOCAL_PROCESS_COUNT": "8",
            "TPU_VISIBLE_CHIPS": "0",
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "2,4,1",
            "TPU_PROCESS_ADDRESSES": V5E8_ADDRESSES,
            "TPU_PROCESS_PORT": "8476",
            "CLOUD_TPU_TASK_ID": "0",
        },
    ),
    (
        (7, 7, 8, 0, ["10.0.0.9"], "2x4"),
        {
            "PJRT_DEVICE": "TPU",
            "PJRT_LOCAL_PROCESS_RANK": "7",
            "PJRT_LOCAL_PROCESS_COUNT": "8",
            "TPU_VISIBLE_CHIPS": "7",
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "2,4,1",
            "TPU_PROCESS_ADDRESSES": V5E8_ADDRESSES,
            "TPU_PROCESS_PORT": "8483",
            "CLOUD_TPU_TASK_ID": "7",
        },
    ),
    (
        (0, 0, 4, 0, ["10.0.0.9"], None),
        {
            "PJRT_DEVICE": "TPU",
            "PJRT_LOCAL_PROCESS_RANK": "0",
            "PJRT_LOCAL_PROCESS_COUNT": "4",
            "TPU_VISIBLE_CHIPS": "0",
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "2,2,1",
            "TPU_PROCESS_ADDRESSES": V4_8_ADDRESSES,
            "TPU_PROCESS_PORT": "8476",
            "CLOUD_TPU_TASK_ID": "0",
        },
    ),
    (
        (3, 3, 4, 0, ["10.0.0.9"], "2x2x1"),
        {
            "PJRT_DEVICE": "TPU",
            "PJRT_LOCAL_PROCESS_RANK": "3",
            "PJRT_LOCAL_PROCESS_COUNT": "4",
            "TPU_VISIBLE_CHIPS": "3",
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "2,2,1",
            "TPU_PROCESS_ADDRESSES": V4_8_ADDRESSES,
            "TPU_PROCESS_PORT": "8479",
            "CLOUD_TPU_TASK_ID": "3",
        },
    ),
    (
        (0, 0, 4, 0, V4_16_HOSTS, "2x2x2"),
        {
            "PJRT_DEVICE": "TPU",
            "PJRT_LOCAL_PROCESS_RANK": "0",
            "PJRT_LOCAL_PROCESS_COUNT": "4",
            "TPU_VISIBLE_CHIPS": "0",
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "2,2,2",
            "TPU_PROCESS_ADDRESSES": V4_16_ADDRESSES,
            "TPU_PROCESS_PORT": "8476",
            "CLOUD_TPU_TASK_ID": "0",
        },
    ),
    (
        (5, 1, 4, 1, V4_16_HOSTS, "2x2x2"),
        {
            "PJRT_DEVICE": "TPU",
            "PJRT_LOCAL_PROCESS_RANK": "1",
            "PJRT_LOCAL_PROCESS_COUNT": "4",
            "TPU_VISIBLE_CHIPS": "1",
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "2,2,2",
            "TPU_PROCESS_ADDRESSES": V4_16_ADDRESSES,
            "TPU_PROCESS_PORT": "8477",
            "CLOUD_TPU_TASK_ID": "5",
        },
    ),
    (
        (7, 3, 4, 1, V4_16_HOSTS, "2x2x2"),
        {
            "PJRT_DEVICE": "TPU",
            "PJRT_LOCAL_PROCESS_RANK": "3",
            "PJRT_LOCAL_PROCESS_COUNT": "4",
            "TPU_VISIBLE_CHIPS": "3",
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "2,2,2",
            "TPU_PROCESS_ADDRESSES": V4_16_ADDRESSES,
            "TPU_PROCESS_PORT": "8479",
            "CLOUD_TPU_TASK_ID": "7",
        },
    ),
    (
        (0, 0, 4, 0, V5E16_HOSTS, "4x4"),
        {
            "PJRT_DEVICE": "TPU",
            "PJRT_LOCAL_PROCESS_RANK": "0",
            "PJRT_LOCAL_PROCESS_COUNT": "4",
            "TPU_VISIBLE_CHIPS": "0",
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "4,4,1",
            "TPU_PROCESS_ADDRESSES": V5E16_ADDRESSES,
            "TPU_PROCESS_PORT": "8476",
            "CLOUD_TPU_TASK_ID": "0",
        },
    ),
    (
        (6, 2, 4, 1, V5E16_HOSTS, "4x4"),
        {
            "PJRT_DEVICE": "TPU",
            "PJRT_LOCAL_PROCESS_RANK": "2",
            "PJRT_LOCAL_PROCESS_COUNT": "4",
            "TPU_VISIBLE_CHIPS": "2",
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "4,4,1",
            "TPU_PROCESS_ADDRESSES": V5E16_ADDRESSES,
            "TPU_PROCESS_PORT": "8478",
            "CLOUD_TPU_TASK_ID": "6",
        },
    ),
    (
        (15, 3, 4, 3, V5E16_HOSTS, "4x4"),
        {
            "PJRT_DEVICE": "TPU",
            "PJRT_LOCAL_PROCESS_RANK": "3",
            "PJRT_LOCAL_PROCESS_COUNT": "4",
            "TPU_VISIBLE_CHIPS": "3",
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "4,4,1",
            "TPU_PROCESS_ADDRESSES": V5E16_ADDRESSES,
            "TPU_PROCESS_PORT": "8479",
            "CLOUD_TPU_TASK_ID": "15",
        },
    ),
]


@pytest.mark.parametrize(("pod_type", "ray_type", "topology", "hosts", "per_host"), SLICES)
def test_slice_counts(pod_type: str, ray_type: str, topology: str, hosts: int, per_host: int) -> None:
    spec = parse_pod_type(pod_type)
    assert (spec.topology, spec.num_hosts, spec.chips_per_host) == (topology, hosts, per_host)
    assert spec.num_chips == hosts * per_host
    assert spec.pod_type == pod_type
    assert spec.accelerator_type == ray_type
    assert spec.multi_host == (hosts > 1)
    assert slice_spec(ray_type, topology) == spec


@pytest.mark.parametrize(("pod_type", "ray_type", "topology", "hosts", "per_host"), SLICES)
def test_workers_per_layout(pod_type: str, ray_type: str, topology: str, hosts: int, per_host: int) -> None:
    spec = slice_spec(ray_type, topology)
    assert workers_for_layout(spec, "spmd") == (hosts, {"TPU": per_host})
    assert workers_for_layout(spec, "multiprocess") == (hosts * per_host, {"TPU": 1})
    check_num_workers(spec, "spmd", hosts)
    check_num_workers(spec, "multiprocess", hosts * per_host)


@pytest.mark.parametrize(
    ("pod_type", "layout", "given", "message"),
    [
        ("v5litepod-8", "spmd", 8, "v5litepod-8 (1 host(s) x 8 chips) with layout 'spmd' needs num_workers=1"),
        ("v5litepod-8", "multiprocess", 1, "layout 'multiprocess' needs num_workers=8 (one per chip), got 1"),
        ("v4-8", "multiprocess", 8, "v4-8 (1 host(s) x 4 chips) with layout 'multiprocess' needs num_workers=4"),
        ("v4-16", "spmd", 8, "v4-16 (2 host(s) x 4 chips) with layout 'spmd' needs num_workers=2 (one per host)"),
        ("v5litepod-16", "spmd", 1, "needs num_workers=4 (one per host), got 1"),
        ("v5litepod-16", "multiprocess", 4, "needs num_workers=16 (one per chip), got 4"),
    ],
)
def test_worker_count_mismatch_names_the_right_number(pod_type: str, layout: str, given: int, message: str) -> None:
    with pytest.raises(ValueError) as info:
        check_num_workers(parse_pod_type(pod_type), layout, given)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_accelerator_type_spellings() -> None:
    v5e8 = parse_pod_type("v5litepod-8")
    for spelling in ("TPU-V5LITEPOD", "v5litepod", "v5e", "V5LITE_POD", "tpu-v5litepod"):
        assert slice_spec(spelling, "2x4") == v5e8
    assert parse_pod_type("v5e-8") == v5e8
    assert parse_pod_type("v5p-16") == slice_spec("TPU-V5P", "2x2x2")
    assert parse_pod_type("v6e-8").chips_per_host == 8
    assert parse_pod_type("v6e-16").num_hosts == 4


@pytest.mark.parametrize(
    ("accelerator_type", "topology", "message"),
    [
        ("TPU-V9", "2x2", "unknown TPU accelerator type 'TPU-V9'"),
        ("v4-16", "2x2x2", "is a pod type; use parse_pod_type"),
        ("TPU-V4", "2x4", "must have 3 dimensions"),
        ("TPU-V5LITEPOD", "2x2x2", "must have 2 dimensions"),
        ("TPU-V4", "2x2x3", "is not a v4 slice"),
        ("TPU-V5LITEPOD", "3x3", "is not a v5litepod slice"),
        ("TPU-V4", "2xx2", "malformed TPU topology"),
        ("TPU-V4", "0x2x2", "malformed TPU topology"),
        ("TPU-V6E", "", "malformed TPU topology"),
    ],
)
def test_slice_spec_errors(accelerator_type: str, topology: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        slice_spec(accelerator_type, topology)


@pytest.mark.parametrize(
    ("pod_type", "message"),
    [
        ("v4-15", "counts 2 cores per chip"),
        ("v4", "malformed TPU pod type"),
        ("v5litepod-2", "no standard topology"),
        ("v9-8", "unknown TPU accelerator type"),
    ],
)
def test_parse_pod_type_errors(pod_type: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_pod_type(pod_type)


def test_unknown_layout() -> None:
    with pytest.raises(ValueError, match="unknown TPU layout 'per-core'"):
        workers_for_layout(parse_pod_type("v4-8"), "per-core")


def test_agrees_with_ray() -> None:
    """Ray's own TPU arithmetic (what ScalingConfig(use_tpu=True, topology=...) schedules) gives the same slices."""
    from ray._private.accelerators import tpu as ray_tpu
    from ray.util.tpu import get_tpu_worker_resources

    pod_types = ["v4-8", "v4-16", "v4-32", "v4-128", "v5p-8", "v5p-64", "v5litepod-1", "v5litepod-4", "v5litepod-8"]
    pod_types += ["v5litepod-16", "v5litepod-64", "v6e-1", "v6e-4", "v6e-8", "v6e-16", "v6e-256"]
    for pod_type in pod_types:
        spec = parse_pod_type(pod_type)
        num_workers, resources = get_tpu_worker_resources(spec.topology, spec.accelerator_type)
        assert (num_workers, resources["TPU"]) == (spec.num_hosts, spec.chips_per_host), pod_type
        assert ray_tpu.infer_tpu_pod_type_from_topology(spec.topology, spec.accelerator_type) == pod_type
        assert ray_tpu.get_num_tpu_visible_chips_per_host(pod_type) == spec.chips_per_host
        assert ray_tpu.get_total_chips_from_accelerator_type(pod_type) == spec.num_chips
        assert ray_tpu.TPUAcceleratorManager.is_valid_tpu_accelerator_topology(spec.generation, spec.topology)


@pytest.mark.parametrize(("args", "expected"), PJRT_CASES)
def test_pjrt_env(args: tuple, expected: dict[str, str]) -> None:
    world_rank, local_rank, per_host, host_index, hosts, topology = args
    env = pjrt_env_for_process(world_rank, local_rank, per_host, host_index, hosts, topology=topology)
    assert env == expected


def test_pjrt_env_other_port() -> None:
    env = pjrt_env_for_process(5, 1, 4, 1, V4_16_HOSTS, port=9000, topology="2x2x2")
    assert env["TPU_PROCESS_PORT"] == "9001"
    assert env["TPU_PROCESS_ADDRESSES"].split(",")[4:6] == ["10.0.0.2:9000", "10.0.0.2:9001"]


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((0, 0, 4, 0, []), {}, "host_addresses is empty"),
        ((4, 4, 4, 0, ["h"]), {}, "local_rank 4 is outside 0..3"),
        ((0, 0, 4, 2, V4_16_HOSTS), {"topology": "2x2x2"}, "host_index 2 is outside 0..1"),
        ((1, 1, 4, 1, V4_16_HOSTS), {"topology": "2x2x2"}, "world rank 1 is host 1 local rank 1, which torch_xla"),
        ((0, 0, 4, 0, V4_16_HOSTS), {}, "multi-host slice needs topology="),
        ((0, 0, 4, 0, V4_16_HOSTS), {"topology": "2x2x1"}, "has 4 chips but 2 host"),
        ((0, 0, 3, 0, ["h"]), {}, "1, 2, 4 or 8 TPU chips"),
    ],
)
def test_pjrt_env_errors(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pjrt_env_for_process(*args, **kwargs)


def test_apply_env_overrides_ray_and_drops_old_bounds() -> None:
    environ = {"TPU_VISIBLE_CHIPS": "3", "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1", "TPU_HOST_BOUNDS": "1,1,1", "HOME": "/h"}
    env = pjrt_env_for_process(1, 1, 4, 0, ["h"])
    apply_env(env, environ)
    assert environ == {**env, "HOME": "/h"}
    environ = {"TPU_HOST_BOUNDS": "1,1,2"}
    apply_env({"PJRT_DEVICE": "TPU"}, environ)
    assert environ == {"TPU_HOST_BOUNDS": "1,1,2", "PJRT_DEVICE": "TPU"}


def test_apply_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("TPU_HOST_BOUNDS", "1,1,1")
    monkeypatch.delenv("TPU_PROCESS_BOUNDS", raising=False)
    apply_env({"TPU_PROCESS_BOUNDS": "2,2,1"})
    assert os.environ["TPU_PROCESS_BOUNDS"] == "2,2,1"
    assert "TPU_HOST_BOUNDS" not in os.environ
    monkeypatch.delenv("TPU_PROCESS_BOUNDS")


# Runs torch_xla's own configure_topology (what xmp.spawn calls in each process) on faked TPU metadata.
TORCH_XLA_TOPOLOGY = """
import json, os, sys
cases = json.loads(sys.argv[1])
clean = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "PJRT_LOCAL", "CLOUD_TPU"))}
from torch_xla._internal import tpu
out = []
for meta, local_rank, local_world_size in cases:
    os.environ.clear()
    os.environ.update(clean, TPU_SKIP_MDS_QUERY="1", **meta)
    tpu.configure_topology(local_rank, local_world_size)
    out.append({k: v for k, v in os.environ.items() if k.startswith(("TPU_PROCESS", "TPU_VISIBLE", "TPU_CHIPS_PER_P",
                                                                      "CLOUD_TPU_TASK"))})
print("RESULT " + json.dumps(out))
"""

# GCP TPU metadata per slice (keyed by its chip grid): host bounds times chips-per-host bounds is the chip grid.
METADATA = {
    "2,4,1": {"TPU_ACCELERATOR_TYPE": "v5litepod-8", "TPU_HOST_BOUNDS": "1,1,1", "TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1"},
    "2,2,1": {"TPU_ACCELERATOR_TYPE": "v4-8", "TPU_HOST_BOUNDS": "1,1,1", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"},
    "2,2,2": {"TPU_ACCELERATOR_TYPE": "v4-16", "TPU_HOST_BOUNDS": "1,1,2", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"},
    "4,4,1": {"TPU_ACCELERATOR_TYPE": "v5litepod-16", "TPU_HOST_BOUNDS": "2,2,1", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"},
}


@pytest.mark.xla
def test_pjrt_env_matches_torch_xla() -> None:
    """Every case above, computed by torch_xla 2.9's configure_topology itself (XLA is imported, no device used)."""
    cases = []
    for (_, local_rank, per_host, host_index, hosts, _), expected in PJRT_CASES:
        meta = METADATA[expected["TPU_PROCESS_BOUNDS"]]
        names = ",".join(hosts)
        cases.append([{**meta, "TPU_WORKER_ID": str(host_index), "TPU_WORKER_HOSTNAMES": names}, local_rank, per_host])
    done = run_python(["-c", TORCH_XLA_TOPOLOGY, json.dumps(cases)], env={"PJRT_DEVICE": "CPU"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    from_torch_xla = json.loads(line.removeprefix("RESULT "))
    for (_, expected), theirs in zip(PJRT_CASES, from_torch_xla):
        ours = {k: v for k, v in expected.items() if not k.startswith("PJRT_")}
        assert theirs == ours


# ---------------------------------------------------------------- launcher: config -> Ray ScalingConfig
@pytest.mark.parametrize(
    ("accelerator", "topology", "layout", "workers", "tpu_per_worker"),
    [
        ("TPU-V5LITEPOD", "2x4", "spmd", 1, 8),
        ("TPU-V5LITEPOD", "4x4", "spmd", 4, 4),
        ("TPU-V5LITEPOD", "4x4", "multiprocess", 16, 1),
        ("TPU-V4", "2x2x2", "spmd", 2, 4),
    ],
)
def test_config_becomes_a_ray_tpu_scaling_config(accelerator, topology, layout, workers, tpu_per_worker):
    from ray.train import ScalingConfig

    from raytpu.config import load_config
    from raytpu.driver.ray_trainer import scaling_kwargs

    cfg, _ = load_config(
        "jobs/mshnet/small.yaml",
        [
            "runtime=xla",
            f"scaling.tpu.accelerator_type={accelerator}",
            f"scaling.tpu.topology={topology}",
            f"scaling.tpu.layout={layout}",
            f"scaling.num_workers={workers}",
            "data.global_batch_size=32",
        ],
    )
    kwargs = scaling_kwargs(cfg)
    scaling = ScalingConfig(**kwargs)  # Ray's own validation of topology vs workers
    assert scaling.use_tpu and scaling.topology == topology
    assert scaling.num_tpus_per_worker == tpu_per_worker


def test_wrong_worker_count_for_the_slice_is_a_clear_error():
    from raytpu.config import load_config
    from raytpu.driver.ray_trainer import scaling_kwargs

    cfg, _ = load_config(
        "jobs/mshnet/small.yaml",
        [
            "runtime=xla",
            "scaling.tpu.accelerator_type=TPU-V5LITEPOD",
            "scaling.tpu.topology=4x4",
            "scaling.num_workers=2",
        ],
    )
    with pytest.raises(ValueError, match="needs num_workers=4"):
        scaling_kwargs(cfg)


# ---------------------------------------------------------------- per-chip processes as Ray places them
def test_chip_process_env_numbers_by_tpu_worker_id_not_by_ray_rank() -> None:
    """Ray put ranks 0-3 on TPU worker 1 and 4-7 on worker 0 (seen on the fake TPU cluster)."""
    from raytpu.runtime.tpu import chip_process_env

    spec = parse_pod_type("v4-16")
    placements = [(1, V4_16_HOSTS[1])] * 4 + [(0, V4_16_HOSTS[0])] * 4
    assert chip_process_env(0, placements, spec) == pjrt_env_for_process(4, 0, 4, 1, V4_16_HOSTS, topology="2x2x2")
    assert chip_process_env(7, placements, spec) == pjrt_env_for_process(3, 3, 4, 0, V4_16_HOSTS, topology="2x2x2")
    interleaved = [(r % 2, V4_16_HOSTS[r % 2]) for r in range(8)]
    assert chip_process_env(3, interleaved, spec)["CLOUD_TPU_TASK_ID"] == "5"
    assert chip_process_env(3, interleaved, spec)["TPU_PROCESS_ADDRESSES"] == V4_16_ADDRESSES


def test_chip_process_env_single_host() -> None:
    from raytpu.runtime.tpu import chip_process_env

    env = chip_process_env(5, [(0, "10.0.0.9")] * 8, parse_pod_type("v5litepod-8"))
    assert env == PJRT_CASES[1][1] | {
        "TPU_VISIBLE_CHIPS": "5",
        "TPU_PROCESS_PORT": "8481",
        "CLOUD_TPU_TASK_ID": "5",
        "PJRT_LOCAL_PROCESS_RANK": "5",
    }


@pytest.mark.parametrize(
    ("placements", "message"),
    [
        ([(0, "a")] * 4 + [(1, "b")] * 3, "has 8 chips but 7 chip processes"),
        ([(0, "a")] * 5 + [(1, "b")] * 3, r"processes per worker id: \{0: 5, 1: 3\}"),
        ([(0, "a")] * 4 + [(2, "b")] * 4, r"processes per worker id: \{0: 4, 2: 4\}"),
        ([(0, "a")] * 3 + [(0, "c")] + [(1, "b")] * 4, "TPU worker 0 has two addresses: a and c"),
    ],
)
def test_chip_process_env_errors(placements: list, message: str) -> None:
    from raytpu.runtime.tpu import chip_process_env

    with pytest.raises(ValueError, match=message):
        chip_process_env(0, placements, parse_pod_type("v4-16"))


def test_tpu_worker_id_from_label_then_env() -> None:
    from raytpu.runtime.tpu import tpu_worker_id

    assert tpu_worker_id({"ray.io/tpu-worker-id": "3"}, {"TPU_WORKER_ID": "1"}) == 3
    assert tpu_worker_id({}, {"TPU_WORKER_ID": "1"}) == 1
    with pytest.raises(ValueError, match="cannot tell this host's TPU worker id"):
        tpu_worker_id({}, {})
