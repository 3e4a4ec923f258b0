"""The built-in runtimes, described (``raytpu.runtime.kinds``): ``cpu`` (PyTorch on host CPUs over
gloo), ``cuda`` (PyTorch on NVIDIA GPUs over NCCL) and ``xla`` (PyTorch/XLA on TPUs, or on the CPU
PJRT device). The fourth, TorchTPU, is ``raytpu.runtime.torch_tpu``.

Their devices' documented dense bf16 peak FLOP/s (for MFU: ``raytpu.worker.flops``) and memory (for
the estimate: ``raytpu.config.memory``) are here too. NVIDIA's datasheets print "with sparsity"
numbers twice the dense ones, halved here; a run in fp16 has the same peak on these GPUs, one in
fp32 is still measured against the bf16 peak (its MFU is honestly low). Sources: TPU, per chip (one
device per chip under PJRT, megacore on v4 / v5p): cloud.google.com/tpu/docs pages v4 (275
TFLOPs), v5e (197), v5p (459) and v6e (918), "Peak compute per chip (bf16)". A100 (SXM and PCIe)
312: the A100 datasheet. H100 SXM 989 (1,979 sparse), H100 PCIe 756, H100 NVL 835: the H100
datasheet. H200 SXM 989, H200 NVL 835: the H200 datasheet. L4 121: the L4 datasheet. A10G 70: the
A10G datasheet on AWS (the plain A10's 125 does not apply).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytpu.errors import ConfigError, install_hint
from raytpu.runtime.base import GPUS_WITH_FLOAT8, GPUS_WITHOUT_BF16, device_memory_gb, gpu_peak_flops
from raytpu.runtime.kinds import Machine, RuntimeKind, no_float8
from raytpu.runtime.tpu import tpu_peak_flops

if TYPE_CHECKING:
    from raytpu.runtime.base import Runtime
    from raytpu.runtime.placement import ClusterOffer


def offered(offer: ClusterOffer, resource: str) -> str | None:
    """Why a cluster gives ``resource``: it has some up, or its autoscaler can start some."""
    if offer.up(resource):
        where = "this machine has" if offer.this_machine else "the cluster has"
        return f"{where} {offer.up(resource):g} {resource}"
    types = offer.startable(resource)
    if types:
        names = ", ".join(f"{t.name} ({t.resources[resource]:g} {resource})" for t in types)
        return f"the autoscaler can start {resource} nodes: {names}; none is up yet"
    return None


def tpu_scaling(cfg: Any, resources: dict[str, float], layout: str) -> dict[str, Any]:
    """``ScalingConfig`` arguments of TPU workers: a worker's chips, or a whole slice that Ray
    gang-schedules (one worker a host under ``spmd``, a chip under ``multiprocess``), checked
    against ``scaling.num_workers``."""
    from raytpu.runtime.tpu import check_num_workers, slice_spec, workers_for_layout

    kwargs: dict[str, Any] = {"use_gpu": False, "resources_per_worker": resources}
    if resources.get("TPU"):  # one worker's chips (raytpu.runtime.placement)
        kwargs["use_tpu"] = True
    tpu = cfg.scaling.tpu
    if tpu.accelerator_type:
        spec = slice_spec(tpu.accelerator_type, tpu.topology)
        check_num_workers(spec, layout, cfg.scaling.num_workers, tpu.slices)
        _, chips = workers_for_layout(spec, layout)
        kwargs.update(
            use_tpu=True,
            topology=spec.topology,
            accelerator_type=spec.accelerator_type,
            resources_per_worker={**resources, **chips},
        )
    return kwargs


# ------------------------------------------------------------------ the runtimes
class CPU(RuntimeKind):
    name = "cpu"
    words = "PyTorch on the hosts' CPUs, data-parallel over gloo"
    auto_order = 90

    def auto_reason(self, offer: ClusterOffer) -> str | None:
        searched = " or among the node types its autoscaler can start" if offer.node_types else ""
        return f"no TPU or GPU on the cluster{searched}"


class CUDA(RuntimeKind):
    name = "cuda"
    words = "PyTorch on NVIDIA GPUs, one worker a GPU, data-parallel over NCCL"
    accelerator = "GPU"
    auto_order = 20
    process_group = "nccl"
    compiles_by_default = True  # a step gains a third and more once its kernels are fused

    def auto_reason(self, offer: ClusterOffer) -> str | None:
        return offered(offer, "GPU")

    def here(self, machine: Machine) -> bool:
        return machine.gpus > 0

    def precision(self, requested: str, bf16_supported: bool = True) -> tuple[str, str | None]:
        if requested == "fp8" and not bf16_supported:
            raise no_float8(self.name, "this GPU has no bf16 either")
        if requested == "auto":
            return ("bf16" if bf16_supported else "fp16"), None
        if requested == "bf16" and not bf16_supported:
            return "fp16", "this GPU has no bf16 support; using fp16 with a gradient scaler"
        return requested, None

    def auto_precision_reason(self, precision: str) -> str:
        if precision == "bf16":
            return "bf16 autocast with fp32 weights, as on every GPU since Ampere"
        return "this GPU has no bf16: fp16 autocast with a gradient scaler"

    def plan_precision(self, requested: str, offer: ClusterOffer) -> tuple[str, str | None]:
        kinds = offer.accelerator_types("GPU")
        if requested == "fp8" and kinds and not kinds & GPUS_WITH_FLOAT8:
            raise no_float8(self.name, f"the cluster's GPUs are {', '.join(sorted(kinds))}")
        return self.precision(requested, not (kinds and kinds <= GPUS_WITHOUT_BF16))  # else each worker's GPU decides

    def scaling(self, cfg: Any, resources: dict[str, float]) -> dict[str, Any]:
        return {"use_gpu": True, "resources_per_worker": resources}

    def device_memory_gb(self, gpu_kinds: frozenset[str]) -> tuple[float | None, str]:
        known = device_memory_gb(gpu_kinds)
        if known is not None:
            return known, f"a GPU of this cluster ({', '.join(sorted(gpu_kinds))})"
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return props.total_memory / 1e9, f"this machine's {props.name}"
        return None, ""

    def peak_flops(self, device_kind: str) -> float | None:
        return gpu_peak_flops(device_kind)

    def check_local(self, cfg: Any, offer: ClusterOffer) -> None:
        gpus, workers = offer.up("GPU"), cfg.scaling.num_workers
        if not gpus:
            raise ConfigError("scaling.runtime=cuda but this machine has no GPU; use scaling.runtime=auto (or cpu)")
        if workers > gpus:
            raise ConfigError(
                f"{workers} cuda workers need {workers} GPUs but this machine has {gpus:g}: "
                f"set scaling.num_workers={gpus:g} (the global batch stays the same), or scaling.runtime=cpu"
            )

    def check_worker(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "scaling.runtime=cuda but this worker sees no GPU: check the node's GPU (nvidia-smi, "
                "CUDA_VISIBLE_DEVICES), or run with scaling.runtime=cpu"
            )

    def local_bf16(self) -> bool:
        from raytpu.runtime.base import local_gpu_has_bf16

        return local_gpu_has_bf16()

    def make(self, precision: str, world: int, rank: int, local_rank: int, options: dict[str, Any]) -> Runtime:
        from raytpu.runtime.torch_fsdp import native_runtime

        return native_runtime(self.name, "cuda", precision, world, rank, local_rank, options)

    def accelerate_env(self) -> dict[str, str]:
        return {"USE_TORCH_XLA": "0"}


class XLA(RuntimeKind):
    name = "xla"
    words = "PyTorch/XLA on TPUs (or on the CPU PJRT device), one worker a host (SPMD) or a chip"
    accelerator = "TPU"
    auto_order = 10
    offers_torch_compile = False  # XLA compiles every step already
    checkpoints_units = True  # torch_xla's checkpoint: XLA's CSE would merge a plain one's recompute back
    sharded_checkpoints_differ = False  # FSDPv2 writes the plain model's names
    mesh_over_workers = False  # one SPMD program over every chip of the slices
    scans_layers = True

    def auto_reason(self, offer: ClusterOffer) -> str | None:
        return offered(offer, "TPU")

    def here(self, machine: Machine) -> bool:
        return machine.tpu_chips > 0 and "torch_xla" in machine.installed

    def missing_here(self, machine: Machine) -> str:
        if machine.tpu_chips and not {"torch_xla", "torch_tpu"} & machine.installed:
            return f"a TPU is present but torch_xla is not installed: {install_hint('tpu')}"
        return ""

    def precision(self, requested: str, bf16_supported: bool = True) -> tuple[str, str | None]:
        if requested == "fp8":
            raise no_float8(self.name)
        if requested == "auto":
            return "bf16", None
        if requested == "fp16":
            return "bf16", "precision fp16 is not supported on XLA/TPU; using bf16 instead"
        return requested, None

    def auto_precision_reason(self, precision: str) -> str:
        return "TPUs compute in bf16"

    def scaling(self, cfg: Any, resources: dict[str, float]) -> dict[str, Any]:
        return tpu_scaling(cfg, resources, cfg.scaling.tpu.layout)

    def torch_config(self, verbose: bool = False) -> Any:
        from raytpu.runtime.ray_backend import XLAHostTorchConfig

        return XLAHostTorchConfig()

    def data_parallel_replicas(self, cfg: Any) -> int:
        """A chip under SPMD (each worker drives its host's chips), else a worker."""
        scaling = cfg.scaling
        if scaling.tpu.layout == "multiprocess":
            return scaling.num_workers
        if not scaling.tpu.accelerator_type and scaling.resources_per_worker.get("TPU"):  # a host's chips each
            return int(scaling.resources_per_worker["TPU"]) * scaling.num_workers
        if not scaling.tpu.accelerator_type:
            raise ConfigError(
                "per-device batch sizes on xla need the slice's chip count: set scaling.tpu.accelerator_type "
                "(and topology), or give data.global_batch_size instead"
            )
        from raytpu.runtime.tpu import slice_spec

        return slice_spec(scaling.tpu.accelerator_type, scaling.tpu.topology).num_chips * scaling.tpu.slices

    def devices_per_worker(self, cfg: Any) -> int:
        scaling = cfg.scaling
        if scaling.tpu.layout == "multiprocess":
            return 1
        if scaling.tpu.accelerator_type:
            from raytpu.runtime.tpu import slice_spec

            return slice_spec(scaling.tpu.accelerator_type, scaling.tpu.topology).chips_per_host
        return int(scaling.resources_per_worker.get("TPU", 1)) or 1

    def sharding(self, cfg: Any, precision: str) -> dict[str, Any]:
        """FSDPv2 over the SPMD mesh's ``fsdp`` axis (every device the tensor axis leaves, unless
        ``sharding.mesh.fsdp`` says otherwise); a mesh with ``fsdp`` or ``tensor`` over 1 is sharding
        too, and SPMD."""
        mesh = cfg.sharding.mesh
        if cfg.sharding.strategy == "full_shard" and mesh.fsdp == 1:
            return {"xla.spmd": True, "sharding.mesh.fsdp": -1}
        if mesh.tensor != 1 or (cfg.xla.spmd and mesh.fsdp != 1):
            return {"xla.spmd": True, "sharding.strategy": "full_shard"}
        return {}

    def no_devices(self, offer: ClusterOffer, xla_on_cpu: bool) -> str:
        if not (offer.this_machine or xla_on_cpu):
            raise ValueError(
                f"scaling.runtime=xla but the cluster has no TPU and its autoscaler can start none "
                f"({offer.inventory()}): add a TPU node type (cluster.yaml), use scaling.runtime=auto, or export "
                "PJRT_DEVICE=CPU to run XLA on the workers' CPUs"
            )
        return "the cluster has no TPU: the xla workers run XLA on the CPU PJRT device"

    def peak_flops(self, device_kind: str) -> float | None:
        return tpu_peak_flops(device_kind)

    def check_local(self, cfg: Any, offer: ClusterOffer) -> None:
        if cfg.scaling.num_workers > 1:
            raise ConfigError("--local with runtime=xla runs one worker (use xla.spmd=true for several devices)")

    def check_workers(self, cfg: Any, offer: ClusterOffer) -> None:
        """FSDPv2 across several xla workers needs XLA collectives between them (TPU hosts). Workers
        on the CPU PJRT device have none: their sharded gradients would be gathered to the host for
        gloo, a new graph per gradient at every step, until LLVM runs out of memory."""
        mesh, tpu = cfg.sharding.mesh, cfg.scaling.tpu
        if tpu.slices > 1 and tpu.layout == "multiprocess":
            raise ConfigError(
                "scaling.tpu.slices over 1 runs one worker a host (scaling.tpu.layout=spmd), whose SPMD mesh spans "
                "the slices; the multiprocess layout has no multislice mesh"
            )
        if tpu.accelerator_type and cfg.xla.spmd:  # the slices' chips are known: the mesh must cover them
            from raytpu.parallel.mesh import resolve_mesh
            from raytpu.parallel.slices import slice_mesh
            from raytpu.runtime.tpu import slice_spec

            chips = slice_spec(tpu.accelerator_type, tpu.topology).num_chips * tpu.slices
            if tpu.slices > 1:
                slice_mesh(chips, tpu.slices, mesh.data, mesh.fsdp, mesh.tensor)
            else:
                resolve_mesh(chips, mesh.data, mesh.fsdp, mesh.tensor, f"chips of the {tpu.accelerator_type} slice")
        sharded = cfg.xla.spmd and (mesh.fsdp != 1 or mesh.tensor != 1)
        if not sharded or cfg.scaling.num_workers == 1 or offer.offers("TPU") or offer.offers("GPU"):
            return
        raise ConfigError(
            f"a sharded SPMD mesh (sharding.mesh.fsdp={mesh.fsdp}, tensor={mesh.tensor}) over "
            f"{cfg.scaling.num_workers} workers of the CPU PJRT device: they share no XLA collectives; run "
            "scaling.num_workers=1, which drives all CPU_NUM_DEVICES devices"
        )

    def make(self, precision: str, world: int, rank: int, local_rank: int, options: dict[str, Any]) -> Runtime:
        from raytpu.runtime.xla import XLARuntime  # imports torch_xla: only on XLA workers

        cache, sharding = options["compile_cache"], options["sharding"]
        return XLARuntime(precision, world, rank, local_rank, options["xla"], cache, sharding)

    def prepare_process(self, cfg: Any, rank: int) -> dict[str, str]:
        """Per-chip layout of a slice: torch_xla's PJRT multi-process environment (before torch_xla
        is imported), from the slice and every worker's TPU worker id and host address (Ray does not
        order the hosts by worker id: ``raytpu.runtime.tpu.chip_process_env``)."""
        tpu = cfg.scaling.tpu
        if not tpu.accelerator_type or tpu.layout != "multiprocess":
            return {}
        import ray
        import torch.distributed as dist

        from raytpu.runtime.tpu import apply_env, chip_process_env, slice_spec, tpu_worker_id

        spec = slice_spec(tpu.accelerator_type, tpu.topology)
        mine = (tpu_worker_id(ray.get_runtime_context().get_node_labels()), ray.util.get_node_ip_address())
        placements: list[tuple[int, str]] = [(0, "")] * dist.get_world_size()
        dist.all_gather_object(placements, mine)
        env = chip_process_env(rank, placements, spec)
        apply_env(env)
        return env

    def compile_cache(self, cfg: Any, run_dir: str) -> str:
        """XLA's persistent compile cache: ``xla.compile_cache``, else in the run folder, or on each
        host's disk for a run in a bucket (the cache is read at every compile)."""
        if cfg.xla.compile_cache:
            return cfg.xla.compile_cache
        from raytpu.storage.run_folder import RunFolder

        folder = RunFolder(run_dir)
        return str(folder.local("xla_cache") if folder.remote else Path(run_dir) / "xla_cache")

    def accelerate_env(self) -> dict[str, str]:
        os.environ.pop("ACCELERATE_TORCH_DEVICE", None)  # Ray's "cpu" would mislead Accelerate on an XLA worker
        return {"USE_TORCH_XLA": "1"}

    def accelerate_fp16_as_bf16(self) -> bool:
        return True


#: what ``raytpu.runtime.kinds`` registers of this module
RUNTIMES = (CPU(), CUDA(), XLA())
