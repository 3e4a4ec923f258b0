"""What a runtime means, asked of one description per runtime: :class:`RuntimeKind`.

``config/``, ``driver/`` and ``worker/`` never compare a runtime's name (a test checks it): they ask
the description of ``scaling.runtime`` what its workers ask Ray for, which process group and
device manager they use, the precisions it offers and what ``auto`` picks, its devices' memory and
peak FLOP/s, the sharding it has, how its checkpoints are laid out, what ``raytpu doctor`` checks,
and what ``auto`` needs to pick it. The built-in runtimes are described in
``raytpu.runtime.builtin`` (cpu, cuda, xla) and ``raytpu.runtime.torch_tpu``; adding one is one
module with a ``RUNTIME`` description, named by its import path (``scaling.runtime:
mylab.my_runtime``) or registered with :func:`register`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytpu.errors import ConfigError

if TYPE_CHECKING:
    from raytpu.runtime.base import Runtime
    from raytpu.runtime.placement import ClusterOffer

#: precisions a config may ask for (``scaling.precision``)
PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp8")
#: fp8's scalings (``scaling.fp8_recipe``, torchao's recipe names)
FP8_RECIPES = ("tensorwise", "rowwise")
#: the precisions that compute in 16-bit values (fp8 as bf16: its float8 layers' 1-byte copies are
#: the smaller part of what a step holds)
LOW_PRECISIONS = ("bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Machine:
    """One machine as ``raytpu doctor`` finds it: its TPU chips (device files), GPUs and whether
    they have bf16, and which runtime packages are installed (``torch_xla``, ``torch_tpu``)."""

    tpu_chips: int = 0
    gpus: int = 0
    gpu_bf16: bool = True
    installed: frozenset[str] = frozenset()


class RuntimeKind:
    """One runtime, described. The defaults describe a plain PyTorch runtime on host CPUs; each
    runtime overrides what it means differently."""

    #: ``scaling.runtime``'s value
    name = ""
    #: what it runs on, in words (``raytpu doctor``, the docs)
    words = ""
    #: the Ray resource each worker asks for (``GPU``, ``TPU``); "" for none
    accelerator = ""
    #: ``auto`` looks at runtimes in this order and takes the first whose :meth:`auto_reason` says yes
    auto_order = 100
    #: the ``torch.distributed`` backend of its workers (``--local`` processes and Ray's ``TorchConfig``)
    process_group = "gloo"
    #: whether ``loop.compile: auto`` compiles; whether ``loop.compile: true`` is offered at all
    compiles_by_default = False
    offers_torch_compile = True
    #: whether it checkpoints a sharded model's units itself (a job's own gradient checkpointing
    #: is then routed to it: ``sharding.activation_checkpointing``)
    checkpoints_units = False
    #: whether a sharded checkpoint is laid out apart from an unsharded one (DCP shards against one
    #: model file): a resume with the other sharding is then refused before it starts
    sharded_checkpoints_differ = True
    #: whether the mesh (``sharding.mesh``) is over its workers, a device each (else over the devices
    #: of one SPMD program, which its workers feed together)
    mesh_over_workers = True
    #: whether ``xla.scan_layers`` can run the model's repeated blocks as one scanned block
    scans_layers = False

    # ----------------------------------------------------------- auto
    def auto_reason(self, offer: ClusterOffer) -> str | None:
        """Why ``auto`` picks this runtime on ``offer`` (a cluster, or this machine), or None."""
        return "no TPU or GPU on the cluster"

    def here(self, machine: Machine) -> bool:
        """Whether ``machine`` can run it (``raytpu doctor``'s ``auto``): its devices and software."""
        return True

    def missing_here(self, machine: Machine) -> str:
        """What ``machine`` lacks for this runtime though it has its devices ("": nothing, or not its devices)."""
        return ""

    # ------------------------------------------------------- precision
    def precision(self, requested: str, bf16_supported: bool = True) -> tuple[str, str | None]:
        """``(precision, warning)``: what a run asking ``requested`` computes in."""
        if requested == "fp8":
            raise no_float8(self.name)
        if requested in ("auto", "fp16"):
            return "fp32", (
                f"precision fp16 needs a GPU; using fp32 on the {self.name} runtime" if requested == "fp16" else None
            )
        return requested, None

    def auto_precision_reason(self, precision: str) -> str:
        """Why ``precision: auto`` computes in ``precision`` here, in a few words."""
        return "CPUs train in fp32"

    def plan_precision(self, requested: str, offer: ClusterOffer) -> tuple[str, str | None]:
        """The plan's precision on the cluster of ``offer`` (its devices' kinds, where they matter)."""
        return self.precision(requested)

    # -------------------------------------------------------- placement
    def scaling(self, cfg: Any, resources: dict[str, float]) -> dict[str, Any]:
        """What Ray Train's ``ScalingConfig`` gets besides the worker count (``resources``: each
        worker's, from the config)."""
        return {"use_gpu": False, "resources_per_worker": resources}

    def torch_config(self, verbose: bool = False) -> Any:
        """Ray Train's process-group config for its workers (quiet unless ``verbose``)."""
        from raytpu.runtime.ray_backend import quiet_torch_config

        return quiet_torch_config(self.process_group, verbose)

    def data_parallel_replicas(self, cfg: Any) -> int:
        """What TrainingArguments' "per device" counts: here, a worker."""
        return int(cfg.scaling.num_workers)

    def devices_per_worker(self, cfg: Any) -> int:
        """The devices a worker splits its share of the batch over."""
        return 1

    def sharding(self, cfg: Any, precision: str) -> dict[str, Any]:
        """The config's ``sharding`` as this runtime runs it: the keys it changes, or a ConfigError."""
        from raytpu.runtime.torch_fsdp import fsdp2_settings

        return fsdp2_settings(cfg, precision)

    def tpu_layout(self, layout: str) -> str:
        """How its workers take a TPU host's chips: ``scaling.tpu.layout``'s ``spmd`` (one worker a
        host) or ``multiprocess`` (one a chip)."""
        return layout

    def no_devices(self, offer: ClusterOffer, xla_on_cpu: bool) -> str:
        """A placement where the cluster has and can start none of its accelerator: a note, or a
        ValueError (asked for a device that is not there)."""
        return ""

    # ------------------------------------------------------ devices
    def device_memory_gb(self, gpu_kinds: frozenset[str]) -> tuple[float | None, str]:
        """Each device's memory for the estimate, and what the device is (``(None, "")``: unknown)."""
        return None, ""

    def peak_flops(self, device_kind: str) -> float | None:
        """Documented dense bf16 peak FLOP/s of one device of this kind (None: unknown, or a CPU)."""
        return None

    # ------------------------------------------------------ driver checks
    def check_local(self, cfg: Any, offer: ClusterOffer) -> None:
        """``--local``: what this runtime needs of the processes of this machine (a ConfigError)."""

    def check_workers(self, cfg: Any, offer: ClusterOffer) -> None:
        """The plan's workers against what they need of each other (a ConfigError)."""

    # ------------------------------------------------------- workers
    def check_worker(self) -> None:
        """What this worker's machine must have (a RuntimeError that says what is missing)."""

    def local_bf16(self) -> bool:
        """Whether this worker's device computes in bf16 (what ``precision: auto`` and bf16 get)."""
        return True

    def make(self, precision: str, world: int, rank: int, local_rank: int, options: dict[str, Any]) -> Runtime:
        """This worker's :class:`~raytpu.runtime.base.Runtime` (after the process is set up);
        ``options``: ``xla`` settings, ``compile_cache``, ``compile_mode``, ``tf32``, ``sharding``."""
        from raytpu.runtime.torch_fsdp import native_runtime

        return native_runtime(self.name, "cpu", precision, world, rank, local_rank, options)

    def prepare_process(self, cfg: Any, rank: int) -> dict[str, str]:
        """What a Ray worker process needs before its runtime is made (an environment); none here."""
        return {}

    def compile_cache(self, cfg: Any, run_dir: str) -> str:
        """The compiler's persistent cache folder for the run ("" for none)."""
        return ""

    def accelerate_env(self) -> dict[str, str]:
        """What a script under ``raytpu launch`` finds in its environment for Accelerate and Transformers."""
        return {"USE_TORCH_XLA": "0", "ACCELERATE_USE_CPU": "true"}

    def accelerate_fp16_as_bf16(self) -> bool:
        """Whether a launched script's Accelerate fp16 runs as bf16 here (XLA has no fp16 autocast)."""
        return False


def no_float8(runtime: str, gpus: str = "") -> ConfigError:
    """The refusal of ``scaling.precision: fp8`` on a runtime whose devices have no float8, or on
    GPUs without it (``gpus``: what they are)."""
    where = gpus or f"this run is on the {runtime} runtime"
    return ConfigError(
        f"scaling.precision=fp8 needs NVIDIA GPUs with float8 (compute capability 8.9+: L4, L40S, H100, H200, "
        f"B200) and {where}: use scaling.precision=bf16"
    )


#: the modules that describe the built-in runtimes (each a ``RUNTIMES`` tuple), loaded as any
#: runtime's module is: by its import path
BUILTIN = ("raytpu.runtime.builtin", "raytpu.runtime.torch_tpu")

_REGISTRY: dict[str, RuntimeKind] = {}


def register(kind: RuntimeKind) -> RuntimeKind:
    """Make ``kind`` known by its name (what ``scaling.runtime`` and ``auto`` choose from)."""
    _REGISTRY[kind.name] = kind
    return kind


def registered() -> Mapping[str, RuntimeKind]:
    """Every runtime known by name, the built-in ones first."""
    if not _REGISTRY:
        for module in BUILTIN:
            for kind in importlib.import_module(module).RUNTIMES:
                register(kind)
    return _REGISTRY


def kind_of(name: str) -> RuntimeKind:
    """The description of ``scaling.runtime`` ``name``: a registered runtime, or the module of that
    import path's ``RUNTIME`` (registered then)."""
    known = registered()
    if name in known:
        return known[name]
    if "." in name:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"scaling.runtime={name!r}: no module {name} ({exc})") from None
        kind = getattr(module, "RUNTIME", None)
        if not isinstance(kind, RuntimeKind) or kind.name != name:
            raise ConfigError(
                f"scaling.runtime={name!r}: module {name} has no RUNTIME named {name!r} (a raytpu RuntimeKind)"
            )
        return register(kind)
    choices = ", ".join(["auto", *known])
    raise ConfigError(f"scaling.runtime={name!r} is not one of {choices} (or a module path with a RUNTIME)")


def by_auto_order() -> list[RuntimeKind]:
    return sorted(registered().values(), key=lambda kind: kind.auto_order)


def resolve_precision(runtime: str, requested: str, bf16_supported: bool = True) -> tuple[str, str | None]:
    """``(precision, warning)``: what a run of ``runtime`` asking ``requested`` computes in."""
    return kind_of(runtime).precision(requested, bf16_supported)


def precision_reason(runtime: str, requested: str, precision: str) -> str:
    """Why a run computes at ``precision``, in a few words: ``auto -> bf16: <reason>``."""
    if requested != "auto":
        return precision if requested == precision else f"{requested} -> {precision}: not available on {runtime}"
    return f"auto -> {precision}: {kind_of(runtime).auto_precision_reason(precision)}"


def compiles(runtime: str, requested: str) -> bool:
    """``loop.compile``: whether the model goes through ``torch.compile`` (``auto``: where the
    runtime compiles by default, a GPU's; a ConfigError where it is not offered)."""
    kind = kind_of(runtime)
    if requested == "true" and not kind.offers_torch_compile:
        raise ConfigError(f"loop.compile=true: {runtime} compiles every step already; torch.compile is for the others")
    return kind.compiles_by_default if requested == "auto" else requested == "true"
