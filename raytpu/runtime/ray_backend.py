"""Ray Train's torch backends: for XLA workers a gloo process group on the host, no ``torch_tpu``;
for every runtime, gloo's connection notice kept off the console at default verbosity.

Ray 2.60 picks a worker's torch device from the accelerators Ray gave it: a worker holding
``TPU`` resources gets Ray's ``torch_tpu`` device manager, and ``TorchTrainer``'s process-group
setup (``_set_torch_distributed_env_vars`` -> ``ray.train.torch.get_device()``) then fails on
every torch_xla TPU worker with "Using TPUTorchDeviceManager but torch_tpu is not available",
even with ``TorchConfig(backend="gloo")``. raytpu's XLA workers drive the TPU through
torch_xla and keep only a host-side gloo group in torch.distributed, so this backend sets
Ray's per-process device manager to the CPU one in each worker before Ray's own setup runs.

It reaches into two Ray internals (``_TorchBackend`` and the cached device manager);
``tests/test_multinode.py`` runs it on a fake TPU cluster so that a Ray upgrade that
moves them fails a test rather than a TPU run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

from raytpu.console import mute_stdout, unmute_stdout


def _host_device_manager() -> None:
    import ray.air._internal.device_manager as device_manager

    with device_manager._torch_device_manager_lock:
        device_manager._torch_device_manager = device_manager.CPUTorchDeviceManager()


def _forget_host_device() -> None:
    # Ray exports the device it chose for Hugging Face Accelerate; "cpu" would mislead it on an XLA worker.
    os.environ.pop("ACCELERATE_TORCH_DEVICE", None)


class _QuietBackend(_TorchBackend):
    """Ray's torch backend, after the config's ``before`` (if any) ran on every worker, with gloo's
    per-rank connection notice (printed from C++ on stdout) hidden while the process group connects
    unless the config is not ``quiet``."""

    def on_start(self, worker_group: Any, backend_config: TorchConfig) -> None:
        before = getattr(backend_config, "before", None)
        if before is not None:
            worker_group.execute(before)
        if not getattr(backend_config, "quiet", True):
            super().on_start(worker_group, backend_config)
            return
        worker_group.execute(mute_stdout)
        try:
            super().on_start(worker_group, backend_config)
        finally:
            worker_group.execute(unmute_stdout)


def _tpu_host() -> tuple[str, int, str]:
    """This worker's TPU host: its slice's name, its TPU worker id there and its address (no name
    off a TPU slice: XLA on CPU workers)."""
    import ray

    from raytpu.runtime.tpu import tpu_worker_id

    labels = ray.get_runtime_context().get_node_labels()
    name = labels.get("ray.io/tpu-slice-name", "")
    return (name, tpu_worker_id(labels), ray.util.get_node_ip_address()) if name else ("", 0, "")


def _set_env(env: dict[str, str]) -> None:
    os.environ.update(env)


class _XLAHostBackend(_QuietBackend):
    def on_start(self, worker_group: Any, backend_config: TorchConfig) -> None:
        worker_group.execute(_host_device_manager)
        super().on_start(worker_group, backend_config)
        worker_group.execute(_forget_host_device)
        self._join_slices(worker_group)

    @staticmethod
    def _join_slices(worker_group: Any) -> None:
        """Workers on several TPU slices get the multislice environment (``raytpu.parallel.slices``)
        before torch_xla starts in them; workers of one slice get nothing."""
        import ray

        from raytpu.parallel.slices import multislice_env

        envs = multislice_env(worker_group.execute(_tpu_host))
        if any(envs):
            ray.get([worker_group.execute_single_async(rank, _set_env, env) for rank, env in enumerate(envs)])


@dataclass
class QuietTorchConfig(TorchConfig):
    """``TorchConfig`` whose process-group start prints nothing (unless not ``quiet``); ``before``
    runs on every worker first (TorchTPU's loading, which registers its ``tpu_dist`` backend and
    ``tpu`` device)."""

    before: Callable[[], None] | None = None
    quiet: bool = True

    @property
    def backend_cls(self) -> type:
        return _QuietBackend


@dataclass
class XLAHostTorchConfig(TorchConfig):
    """``TorchConfig(backend="gloo")`` whose workers may hold TPU resources without ``torch_tpu``."""

    backend: str = "gloo"

    @property
    def backend_cls(self) -> type:
        return _XLAHostBackend


def quiet_torch_config(backend: str, verbose: bool = False, before: Callable[[], None] | None = None) -> Any:
    """Ray Train's ``TorchConfig`` for ``backend``, whose start prints nothing unless ``verbose``;
    ``before`` runs on every worker before its process group starts."""
    return QuietTorchConfig(backend=backend, before=before, quiet=not verbose)
