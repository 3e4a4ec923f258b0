"""Device backends: the only place that knows cpu vs cuda vs xla.

A :class:`Runtime` turns a device-agnostic model, optimizer and data loader into a running
data-parallel step on one worker (``base``: the interface and the policies; ``torch_ddp``: cpu
and cuda; ``xla``: PyTorch/XLA, imported only when asked for). ``make_runtime`` picks one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from raytpu.runtime.base import (
    Runtime,
    batchnorm_scope,
    clip_or_measure,
    local_gpu_has_bf16,
    pick_runtime,
    resolve_precision,
    tpu_present,
)
from raytpu.runtime.torch_ddp import DDPRuntime

__all__ = [
    "Runtime",
    "batchnorm_scope",
    "clip_or_measure",
    "make_runtime",
    "pick_runtime",
    "resolve_precision",
    "tpu_present",
]


def make_runtime(
    runtime: str,
    precision: str,
    world_size: int,
    rank: int,
    local_rank: int,
    xla_options: Any = None,
    compile_cache: str = "",
    warn: Callable[[str], None] = warnings.warn,
    compile_mode: str = "",
    tf32: bool = True,
    sharding: Any = None,
) -> Runtime:
    """Build the plan's runtime on this worker. What only the device can tell is decided here, once:
    a GPU without bf16 runs ``bf16`` as fp16 with a gradient scaler (said through ``warn``; the
    worker records what ran). ``compile_cache``: XLA's persistent cache folder ("" or "none": none);
    ``compile_mode``: torch.compile's mode on cpu and cuda ("": eager); ``tf32``: on cuda;
    ``sharding``: the ``sharding`` settings (FSDP2 on cpu and cuda when its strategy shards)."""
    if runtime == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "scaling.runtime=cuda but this worker sees no GPU: check the node's GPU (nvidia-smi, "
            "CUDA_VISIBLE_DEVICES), or run with scaling.runtime=cpu"
        )
    bf16_ok = runtime != "cuda" or local_gpu_has_bf16()
    resolved, message = resolve_precision(runtime, precision, bf16_ok)
    if message:
        warn(message)
    if runtime == "xla":
        from raytpu.runtime.xla import XLARuntime  # imports torch_xla: only on XLA workers

        return XLARuntime(resolved, world_size, rank, local_rank, xla_options, compile_cache, sharding)
    if sharding is not None and sharding.strategy != "none":
        from raytpu.runtime.torch_fsdp import FSDPRuntime

        return FSDPRuntime(runtime, resolved, world_size, rank, local_rank, compile_mode, tf32, sharding)
    return DDPRuntime(runtime, resolved, world_size, rank, local_rank, compile_mode, tf32)
