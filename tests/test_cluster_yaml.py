"""cluster.yaml: accepted by Ray's cluster launcher, and its TPU node types agree with raytpu.runtime.tpu."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml

from raytpu.runtime.tpu import SliceSpec, parse_pod_type, slice_spec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def node_types(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return config["available_node_types"]


def tpu_slices(config: dict[str, Any]) -> dict[str, SliceSpec]:
    """TPU node types (Ray's GCP provider: no machineType, an acceleratorType or acceleratorConfig) -> their slice."""
    slices = {}
    for name, node_type in node_types(config).items():
        node = node_type["node_config"]
        if "machineType" in node:
            continue
        if "acceleratorType" in node:
            slices[name] = parse_pod_type(node["acceleratorType"])
        else:
            accelerator = node["acceleratorConfig"]
            slices[name] = slice_spec(accelerator["type"], accelerator["topology"])
            assert parse_pod_type(slices[name].pod_type) == slices[name]
    return slices


def install_commands(config: dict[str, Any]) -> list[str]:
    keys = ("setup_commands", "head_setup_commands", "worker_setup_commands")
    commands = [c for key in keys for c in config.get(key, [])]
    commands += [c for t in node_types(config).values() for c in t.get("worker_setup_commands", [])]
    return [c for c in commands if "pip install" in c]


def test_matches_rays_schema(config: dict[str, Any]) -> None:
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)


def test_ray_launcher_accepts_it(config: dict[str, Any]) -> None:
    """What `ray up` runs first: fill in the GCP defaults, then validate."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(config)))


def test_provider_is_gcp_with_placeholders(config: dict[str, Any]) -> None:
    provider = config["provider"]
    assert provider["type"] == "gcp"
    assert {"region", "availability_zone", "project_id"} <= set(provider)
    assert provider["availability_zone"].startswith(provider["region"])


def test_head_is_a_cpu_vm(config: dict[str, Any]) -> None:
    head = node_types(config)[config["head_node_type"]]
    assert "machineType" in head["node_config"]
    assert "guestAccelerators" not in head["node_config"]
    assert not {"TPU", "GPU"} & set(head["resources"])


def test_tpu_node_types_match_their_slices(config: dict[str, Any]) -> None:
    slices = tpu_slices(config)
    assert slices, "no TPU node type"
    for name, spec in slices.items():
        node_type = node_types(config)[name]
        resources = node_type["resources"]
        # every host of the slice is a Ray node advertising its own chips
        assert resources["TPU"] == spec.chips_per_host, name
        assert resources.get(f"accelerator_type:{spec.accelerator_type}") == 1, name
        assert node_type["node_config"]["runtimeVersion"], name
        installs = [c for c in node_type["worker_setup_commands"] if "$HOME/raytpu" in c]
        assert installs and all("tpu]" in c and '"torch==2.9.0"' in c for c in installs), name


def test_single_host_v5e_8_and_a_multi_host_slice(config: dict[str, Any]) -> None:
    specs = list(tpu_slices(config).values())
    assert any(s.pod_type == "v5litepod-8" and (s.num_hosts, s.chips_per_host) == (1, 8) for s in specs)
    multi = [s for s in specs if s.multi_host]
    assert multi and all(s.pod_type in ("v5litepod-16", "v4-16") for s in multi)


def test_gpu_node_type(config: dict[str, Any]) -> None:
    gpu_types = [t for t in node_types(config).values() if "guestAccelerators" in t["node_config"]]
    assert gpu_types
    for node_type in gpu_types:
        node = node_type["node_config"]
        assert node_type["resources"]["GPU"] == sum(a["acceleratorCount"] for a in node["guestAccelerators"])
        assert node["scheduling"]["onHostMaintenance"] == "TERMINATE"


def test_every_install_pins_torch(config: dict[str, Any]) -> None:
    commands = install_commands(config)
    assert commands
    for command in commands:
        assert '"torch==2.9.0"' in command, command


def test_token_authentication_stays_on(config: dict[str, Any]) -> None:
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=token" in c for c in starts), key
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
