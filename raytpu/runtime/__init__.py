"""Device backends: the only place that knows cpu vs cuda vs xla vs TorchTPU.

What a runtime means on the driver's side is its description (``kinds``: a :class:`RuntimeKind`
per runtime, in ``builtin`` and ``torch_tpu``); on a worker it is a :class:`Runtime` (``base``: the
interface; ``torch_ddp`` and ``torch_fsdp``: the native PyTorch stack of cpu, cuda and TorchTPU;
``xla``: PyTorch/XLA, imported only when asked for), made by :func:`make_runtime`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from raytpu.runtime.base import Runtime, batchnorm_scope, clip_or_measure
from raytpu.runtime.kinds import RuntimeKind, compiles, kind_of, precision_reason, resolve_precision

__all__ = [
    "Runtime",
    "RuntimeKind",
    "batchnorm_scope",
    "clip_or_measure",
    "compiles",
    "kind_of",
    "make_runtime",
    "precision_reason",
    "resolve_precision",
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
    fp8_recipe: str = "tensorwise",
) -> Runtime:
    """Build the plan's runtime on this worker. What only the device can tell is decided here, once:
    a GPU without bf16 runs ``bf16`` as fp16 with a gradient scaler (said through ``warn``; the
    worker records what ran). ``compile_cache``: XLA's persistent cache folder ("" or "none": none);
    ``compile_mode``: torch.compile's mode on the native stack ("": eager); ``tf32``: on cuda;
    ``sharding``: the ``sharding`` settings (FSDP2 on the native stack when its strategy shards);
    ``fp8_recipe``: fp8's scaling (``scaling.fp8_recipe``)."""
    kind = kind_of(runtime)
    kind.check_worker()
    resolved, message = kind.precision(precision, kind.local_bf16())
    if message:
        warn(message)
    options = {
        "xla": xla_options,
        "compile_cache": compile_cache,
        "compile_mode": compile_mode,
        "tf32": tf32,
        "fp8_recipe": fp8_recipe,
        "sharding": sharding,
    }
    return kind.make(resolved, world_size, rank, local_rank, options)
