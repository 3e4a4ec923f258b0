"""TorchTPU, the fourth runtime: native PyTorch on TPU (``torch-tpu``, Google's successor to
torch_xla, whose 2.9 is its last release), on the stack the cuda runtime uses: eager steps, DDP or
FSDP2 with DCP checkpoints, regional ``torch.compile`` (through XLA, its ``tpu`` backend), bf16;
one worker a chip, over the ``tpu_dist`` process group, as Ray Train places them
(``TorchTrainer`` with ``use_tpu``: one chip a worker, ``torch.device("tpu")``).

Facts (``torch-tpu`` 0.2.0, read in its wheel and tried on a machine without TPU, 2026-11-26): it
needs ``torch>=2.11,<=2.15`` and ``libtpu``, so it cannot share an environment with torch_xla
2.9.0's torch 2.9.0 (``pip install 'raytpu[torch_tpu]'``, apart from ``[xla]``); it autoloads
through the ``torch.backends`` entry point on every ``import torch`` (6 s, log lines on stderr)
unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, and registers the ``tpu`` device and ``tpu_dist``
only where TPU chips are on the PCI bus: there is no CPU mode. raytpu turns the autoload off in
its driver and in every worker of another runtime, and loads TorchTPU itself in this runtime's
workers. Not yet run on a TPU: what the first run on one should check is in
docs/runtimes-and-tpu.md.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from raytpu.errors import ConfigError, install_hint
from raytpu.runtime.builtin import offered, tpu_scaling
from raytpu.runtime.kinds import Machine, RuntimeKind, no_float8
from raytpu.runtime.tpu import tpu_peak_flops

if TYPE_CHECKING:
    from raytpu.runtime.base import Runtime
    from raytpu.runtime.placement import ClusterOffer

NO_CPU_MODE = "TorchTPU has no CPU mode (it registers its device only where TPU chips are on the PCI bus)"


def installed() -> bool:
    """torch_tpu on this machine, and torch_xla not (they cannot share one torch)."""
    return importlib.util.find_spec("torch_tpu") is not None and importlib.util.find_spec("torch_xla") is None


class TorchTPU(RuntimeKind):
    name = "torch_tpu"
    words = "native PyTorch on TPU chips (TorchTPU), one worker a chip, DDP or FSDP2 over tpu_dist"
    accelerator = "TPU"
    # before xla, which it yields to where both are installed (its auto_reason asks torch_xla's absence):
    # xla stays the default there until TorchTPU has been measured
    auto_order = 5
    process_group = "tpu_dist"
    compiles_by_default = True

    def auto_reason(self, offer: ClusterOffer) -> str | None:
        reason = offered(offer, "TPU")
        return f"{reason}, and torch_tpu is installed (torch_xla is not)" if reason and installed() else None

    def here(self, machine: Machine) -> bool:
        return machine.tpu_chips > 0 and "torch_tpu" in machine.installed and "torch_xla" not in machine.installed

    def precision(self, requested: str, bf16_supported: bool = True) -> tuple[str, str | None]:
        if requested == "fp8":
            raise no_float8(self.name)
        if requested == "auto":
            return "bf16", None
        if requested == "fp16":
            return "bf16", "precision fp16 is not offered on TPU; using bf16 instead"
        return requested, None

    def auto_precision_reason(self, precision: str) -> str:
        return "TPUs compute in bf16"

    def scaling(self, cfg: Any, resources: dict[str, float]) -> dict[str, Any]:
        """One chip a worker (Ray's TPU device manager, ``torch.device("tpu")``), a slice's chips
        gang-scheduled when the plan names one."""
        return {**tpu_scaling(cfg, {"TPU": 1.0, **resources}, "multiprocess"), "use_tpu": True}

    def tpu_layout(self, layout: str) -> str:
        return "multiprocess"  # one worker a chip, as Ray's TPU device manager places them

    def no_devices(self, offer: ClusterOffer, xla_on_cpu: bool) -> str:
        if offer.this_machine:
            raise ValueError(
                f"scaling.runtime=torch_tpu but this machine has no TPU chips: {NO_CPU_MODE}; run it on a TPU VM, "
                "or use scaling.runtime=auto here"
            )
        raise ValueError(
            f"scaling.runtime=torch_tpu but the cluster has no TPU and its autoscaler can start none "
            f"({offer.inventory()}): {NO_CPU_MODE}; add a TPU node type (cluster.yaml), or use scaling.runtime=auto"
        )

    def peak_flops(self, device_kind: str) -> float | None:
        return tpu_peak_flops(device_kind)

    def check_local(self, cfg: Any, offer: ClusterOffer) -> None:
        """On a TPU VM (the placement refused a machine without chips): TorchTPU installed here."""
        if importlib.util.find_spec("torch_tpu") is None:
            raise ConfigError(
                f"scaling.runtime=torch_tpu needs TorchTPU: {install_hint('torch_tpu')} (apart from [xla])"
            )

    def torch_config(self, verbose: bool = False) -> Any:
        """``tpu_dist``, once TorchTPU is loaded on every worker (:meth:`check_worker`): its autoload
        is off in raytpu's processes, and Ray's TPU device manager and the backend need it."""
        from raytpu.runtime.ray_backend import quiet_torch_config

        return quiet_torch_config(self.process_group, verbose, before=self.check_worker)

    def check_worker(self) -> None:
        """TorchTPU loaded in this process (raytpu keeps its autoload off) and a chip seen through it."""
        import torch

        try:
            from torch_tpu import _loader
        except ImportError:
            raise RuntimeError(
                "scaling.runtime=torch_tpu but this worker has no torch_tpu: pip install "
                "'raytpu[torch_tpu]' on every TPU node"
            ) from None
        _loader.load()
        if not torch.accelerator.is_available():
            raise RuntimeError(f"this worker sees no TPU chip through TorchTPU: {NO_CPU_MODE}")

    def make(self, precision: str, world: int, rank: int, local_rank: int, options: dict[str, Any]) -> Runtime:
        """The native runtime on the chip Ray gave this worker (``torch.device("tpu")``)."""
        from raytpu.runtime.torch_fsdp import native_runtime

        return native_runtime(self.name, "tpu", precision, world, rank, local_rank, options)

    def accelerate_env(self) -> dict[str, str]:
        raise ConfigError(
            "raytpu launch on torch_tpu: Accelerate 1.15 does not know TorchTPU's device; launch the script with "
            "--runtime xla (torch_xla), or port it to a raytpu job"
        )


#: what ``raytpu.runtime.kinds`` registers of this module
RUNTIMES = (TorchTPU(),)
