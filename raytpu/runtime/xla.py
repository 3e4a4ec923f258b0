"""xla runtime: PyTorch/XLA on TPU (or the CPU PJRT device for tests).

Two ways to use a worker's devices:

* one device per worker (``xla.spmd: false``): the worker drives
  ``torch_xla.device()``; with several workers, gradients are all-reduced by
  XLA collectives on TPU, or over the host gloo group on the CPU PJRT device,
  which has no cross-process collectives.
* SPMD (``xla.spmd: true``): one worker per host drives all of its devices;
  the batch is sharded over the ``('data', 'fsdp')`` axes of a ``('data',
  'fsdp', 'tensor')`` mesh (``sharding.mesh``) and XLA inserts the gradient
  all-reduce. With ``sharding.mesh.fsdp > 1`` the model is wrapped in FSDPv2
  (``SpmdFullyShardedDataParallel``): parameters, gradients and optimizer state
  are sharded over the ``fsdp`` axis, the batch over both. With
  ``sharding.mesh.tensor > 1`` each weight is annotated instead: the model's
  tensor-parallel layers along ``tensor`` on one dimension and ``fsdp`` on the
  other, the embeddings and output head along the vocabulary
  (``raytpu.parallel.tensor``). Over several TPU slices the mesh is a hybrid
  one: the ``data`` axis across slices (the data-center network), the others
  within each slice (``raytpu.parallel.slices``).

Scanned layers (``xla.scan_layers``): the model's repeated blocks run as one
``scan_layers`` loop (``raytpu.parallel.scan``), compiled once for any depth.

The training step runs under ``torch_xla.compile(full_graph=True)``: one
graph, and an error naming the culprit if anything in it forces an execution.

torch_xla is imported only here, inside the worker, never in the driver.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from raytpu.errors import ConfigError
from raytpu.parallel.mesh import AXES, resolve_mesh
from raytpu.parallel.scan import layer_stack, require_jax_bridge, scan_in_place
from raytpu.runtime.base import RecompileError, Runtime, batchnorm_scope, clip_or_measure, gpu_peak_flops
from raytpu.runtime.torch_fsdp import NO_UNITS, plain_state_dict_names, units_of, wrapping_units
from raytpu.runtime.tpu import tpu_peak_flops, tpu_present

#: a run's seed times this, plus the step: each step's seed (``begin_step``), apart for every step and seed
STEP_SEEDS = 2**32


def quiet_xla_logs() -> None:
    """Before torch_xla is imported: keep off the console what the libraries under it say at every
    compile or import, none of which the user can act on. XLA's C++ warnings (GSPMD's deprecation,
    once per compiled graph) unless ``TF_CPP_MIN_LOG_LEVEL`` is set (``1`` shows them); flax's notice
    that TensorFlow is absent (torch_xla imports it through torchax at the first sharding); JAX's
    look for a TPU on a machine without one."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.getLogger("absl").addFilter(not_tensorflow_notice)
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def not_tensorflow_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Tensorflow library not found")


class XLARuntime(Runtime):
    name = "xla"
    static_graph = True

    def __init__(
        self,
        precision: str,
        world_size: int,
        rank: int,
        local_rank: int,
        options: Any = None,
        compile_cache: str = "",
        sharding: Any = None,
    ) -> None:
        """``options``: the ``xla`` settings; ``sharding``: the ``sharding`` settings (FSDPv2's units
        and their activation checkpointing)."""
        super().__init__(precision, world_size, rank, local_rank)
        self.layers = list(sharding.layers) if sharding else []
        self._seed = 0  # the run's (``seed``): each training step's random numbers derive from it
        self.activation_checkpointing = bool(sharding and sharding.activation_checkpointing)
        self.axes = sharding.mesh if sharding else None
        if not tpu_present():
            os.environ.setdefault("PJRT_DEVICE", "CPU")
        os.environ["USE_TORCH_XLA"] = "1"  # Transformers' XLA code paths (the driver turns them off for itself)
        quiet_xla_logs()
        import torch_xla
        import torch_xla.runtime as xr

        self.options = options
        self.spmd = bool(options and options.spmd)
        cache_dir = compile_cache or (getattr(options, "compile_cache", "") if options else "")
        if cache_dir and cache_dir != "none":
            os.makedirs(cache_dir, exist_ok=True)
            xr.initialize_cache(os.path.join(cache_dir, f"worker_{rank}"), readonly=False)
        if self.spmd:
            xr.use_spmd()
        self._torch_xla = torch_xla
        self.device = torch_xla.device()
        # CPU PJRT processes share no collectives: several of them are data-parallel over the host gloo group
        self.host_collectives = world_size > 1 and xr.device_type() == "CPU"
        self.mesh = self._make_mesh() if self.spmd else None
        self.recompiles = 0
        self._compiles_before_step = 0

    # ------------------------------------------------------------- topology
    def _make_mesh(self) -> Any:
        """The SPMD mesh over every device of the program: a hybrid one (the data axis across slices)
        where the worker's environment names several slices."""
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        from raytpu.parallel.slices import slice_mesh, slices_here

        devices, slices = xr.global_runtime_device_count(), slices_here()
        axes = (self.axes.data, self.axes.fsdp, self.axes.tensor) if self.axes else (-1, 1, 1)
        try:
            if slices > 1:
                _, ici, dcn = slice_mesh(devices, slices, *axes)
                return xs.HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn, axis_names=AXES)
            shape = resolve_mesh(devices, *axes, "devices of the SPMD program")
        except ConfigError as error:  # the driver cannot count the CPU PJRT device's devices
            raise ValueError(str(error)) from None
        return xs.Mesh(np.arange(devices), shape.shape, AXES)

    @property
    def multi_host(self) -> bool:
        """One SPMD program over several hosts: each host feeds its slice of the global batch."""
        return self.spmd and self.world_size > 1 and not self.host_collectives

    @property
    def local_devices(self) -> int:
        import torch_xla.runtime as xr

        return xr.addressable_runtime_device_count() if self.spmd else 1

    def device_kind(self) -> str:
        """The TPU's accelerator type (``v5litepod-8``) where the VM says it, else PJRT's device
        kind (``TPU v5 lite``, ``cpu``)."""
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if xr.device_type() == "TPU" and os.environ.get("TPU_ACCELERATOR_TYPE"):
            return os.environ["TPU_ACCELERATOR_TYPE"]
        if self.spmd:  # the SPMD virtual device has no kind of its own: PJRT's device type
            return xr.device_type().lower()
        return xm.xla_device_kind()

    def device_peak_flops(self) -> float | None:
        import torch_xla.runtime as xr

        lookup = {"TPU": tpu_peak_flops, "CUDA": gpu_peak_flops}.get(xr.device_type())
        return lookup(self.device_kind()) if lookup else None

    # --------------------------------------------------------------- model
    def prepare_model(
        self, model: nn.Module, find_unused_parameters: bool = False, sync_batchnorm: str = "auto"
    ) -> nn.Module:
        scope = batchnorm_scope(self.name, sync_batchnorm, self.spmd, self.world_size)
        if scope == "global" and sync_batchnorm == "false" and self.spmd:
            warnings.warn("loop.sync_batchnorm=false: under SPMD BatchNorm normalises the global batch", stacklevel=2)
        from torch_xla.distributed.fsdp import checkpoint_module

        static_experts(model)
        model = moved_tied(model, self.device)
        grad_ckpt, scan = self.activation_checkpointing, bool(self.options and self.options.scan_layers)
        units = wrapping_units(model, self.layers) if self.fsdp or grad_ckpt or scan else set()
        if (grad_ckpt or scan) and not units:
            raise ValueError(NO_UNITS)
        specs = self._partition_specs(model) if self.tensor_parallel else {}
        if scan:  # the scan recomputes through its partition, and FSDPv2 wraps the root alone (a wrapper of
            # each unit would hold weights the stack now holds)
            if self.spmd:
                require_jax_bridge()
            stack = layer_stack(model, units_of(model, units))
            prefix = next(name for name, module in model.named_modules() if module is stack)
            for stacked, first in scan_in_place(stack, recompute=grad_ckpt).items():
                # a stacked weight: its layers' spec below the layer axis (FSDPv2 shards only what has none)
                layer_spec = specs.pop(f"{prefix}.{first}", ("fsdp",) if self.fsdp else None)
                if layer_spec:
                    specs[f"{prefix}.{stacked}"] = (None, *layer_spec)
            grad_ckpt, units = False, set()
        for unit in units_of(model, units) if grad_ckpt else []:
            checkpoint_module(unit)  # in place: the unit's forward runs under torch_xla's checkpoint
        self._annotate(model, specs)
        return self._shard(model, units) if self.fsdp and not self.tensor_parallel else model

    @staticmethod
    def _partition_specs(model: nn.Module) -> dict[str, tuple]:
        from raytpu.parallel.tensor import xla_partition_specs

        return xla_partition_specs(model, "fsdp", "tensor")

    def _annotate(self, model: nn.Module, specs: dict[str, tuple]) -> None:
        """Each weight of ``specs`` annotated with its partition spec over the mesh: under tensor
        parallelism every weight (the plan's layers along ``tensor``, everything along ``fsdp``, no
        wrapper), under FSDPv2 the scanned layers' stacked weights (their layer axis whole)."""
        import torch_xla.distributed.spmd as xs

        for name, param in model.named_parameters():
            if specs.get(name):  # a spec shorter than its weight leaves the last dimensions whole
                xs.mark_sharding(param, self.mesh, (*specs[name], *(None,) * (param.dim() - len(specs[name]))))

    @property
    def tensor_parallel(self) -> bool:
        return self.mesh is not None and dict(zip(self.mesh.axis_names, self.mesh.mesh_shape))["tensor"] > 1

    def _shard(self, model: nn.Module, units: set[type[nn.Module]]) -> nn.Module:
        """FSDPv2: each unit (a decoder layer) wrapped on its own, then the rest of the model;
        checkpoints keep plain names."""
        import functools

        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

        def wrap_unit(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
            wrapper = FSDPv2(module, *args, **kwargs)
            plain_state_dict_names(wrapper)
            return wrapper

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=units) if units else None
        # FSDPv2 hooks an optimization barrier onto the root's backward; a Transformers model returns a
        # ModelOutput, for which torch calls no backward hook and says so at every forward
        warnings.filterwarnings("ignore", "For backward hooks to be called", UserWarning)
        return FSDPv2(
            model,
            mesh=self.mesh,
            shard_output=self._shard_batch_outputs,
            auto_wrap_policy=policy,
            auto_wrapper_callable=wrap_unit if units else None,
        )

    @property
    def fsdp(self) -> bool:
        return self.mesh is not None and dict(zip(self.mesh.axis_names, self.mesh.mesh_shape))["fsdp"] > 1

    @staticmethod
    def _shard_batch_outputs(output: Any, mesh: Any) -> None:
        """FSDPv2 needs the forward's outputs sharded like the batch; jobs return
        tuples and lists of tensors, so shard every one along its first dimension."""
        import torch_xla.distributed.spmd as xs
        from torch.utils._pytree import tree_leaves

        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                xs.mark_sharding(leaf, mesh, (("data", "fsdp"),) + (None,) * (leaf.dim() - 1))

    def compiled_step(self) -> Any:
        """The training step as one graph. Host-side gradient averaging (CPU PJRT with
        several workers) has to execute inside the step, so it gets a plain trace."""
        return self._torch_xla.compile(full_graph=not self.host_collectives, name="train_step")

    def autocast(self) -> Any:
        if self.precision == "fp32":
            return super().autocast()
        return torch.autocast("xla", dtype=torch.bfloat16)

    # ---------------------------------------------------------------- step
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float, measure: bool = True
    ) -> torch.Tensor | None:
        grads = [p.grad for p in params if p.grad is not None]
        if self.host_collectives:
            self._all_reduce_on_host(grads)
        elif self.world_size > 1 and not self.spmd:
            import torch_xla.core.xla_model as xm

            xm.reduce_gradients(optimizer)
        norm = clip_or_measure(params, max_norm, measure)
        optimizer.step()
        return norm

    def _all_reduce_on_host(self, grads: list[torch.Tensor]) -> None:
        """Average gradients over the gloo group (CPU PJRT has no cross-process collectives)."""
        self._torch_xla.sync()
        flat = torch.cat([g.detach().cpu().reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world_size
        offset = 0
        for grad in grads:
            size = grad.numel()
            grad.copy_(flat[offset : offset + size].view_as(grad).to(self.device))
            offset += size

    def mark_step(self) -> None:
        self._torch_xla.sync()

    def add_step_closure(self, fn: Callable[..., None], args: tuple = ()) -> None:
        import torch_xla.core.xla_model as xm

        xm.add_step_closure(fn, args, run_async=False)

    def device_loader(self, loader: Iterable, sample: dict[str, torch.Tensor] | None = None) -> Iterator:
        import torch_xla.distributed.parallel_loader as pl

        sharding = self.input_sharding(sample) if self.spmd and sample is not None else None
        return iter(pl.MpDeviceLoader(loader, self.device, input_sharding=sharding))

    def input_sharding(self, sample: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Shard every batch tensor along its batch dimension over the whole mesh."""
        import torch_xla.distributed.spmd as xs

        return {
            key: xs.ShardingSpec(self.mesh, (("data", "fsdp"),) + (None,) * value.dim(), minibatch=self.multi_host)
            for key, value in sample.items()
        }

    # ---------------------------------------------------------- state / rng
    def rng_state(self) -> dict[str, Any]:
        import torch_xla.core.xla_model as xm

        self._torch_xla.sync()  # the seed as the traced ops leave it (a pending graph advances it)
        return {"torch": torch.get_rng_state(), "xla": int(xm.get_rng_state())}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        import torch_xla.core.xla_model as xm

        torch.set_rng_state(state["torch"])
        if "xla" in state:
            xm.set_rng_state(int(state["xla"]))

    def seed(self, seed: int) -> None:
        import torch_xla.core.xla_model as xm

        torch.manual_seed(seed)
        xm.set_rng_state(seed)
        self._seed = seed

    def to_cpu(self, obj: Any) -> Any:
        self._torch_xla.sync()
        return super().to_cpu(obj)

    def compile_count(self) -> int:
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def begin_step(self, step: int) -> None:
        """Also seeds the step's random numbers (dropout) from the run's seed and ``step`` alone:
        torch_xla advances its seed at every graph run (``sync``), and the evaluations, logs and
        checkpoints between two steps run a different number of graphs in a resumed run than in an
        uninterrupted one, so a saved seed did not give a resumed run the same dropout masks."""
        import torch_xla.core.xla_model as xm

        self._compiles_before_step = self.compile_count()
        xm.set_rng_state((self._seed * STEP_SEEDS + step) % 2**64)

    def end_step(self, step: int, steps_into_epoch: int) -> str | None:
        """After warm-up a training step must reuse its compiled graph.

        The first two steps of every epoch (and of a resumed run) may compile: the first
        builds the step, the second sees the optimizer state it created, and jobs may change
        graphs at an epoch (MSHNet's warm-up).
        """
        compiles = self.compile_count() - self._compiles_before_step
        if compiles <= 0 or steps_into_epoch < 2:
            return None
        self.recompiles += compiles
        text = (
            f"step {step} recompiled the XLA graph ({compiles} compile(s)); rerun with PT_XLA_DEBUG_LEVEL=2 "
            "to see why (a changing shape, a Python value or a .item())"
        )
        if self.options is not None and self.options.strict_recompile:
            raise RecompileError(text + "; xla.strict_recompile=true stops the run")
        return text

    def metrics(self) -> dict[str, float]:
        return {**xla_metrics(), "xla/recompiles_after_warmup": float(self.recompiles)}

    def compile_seconds(self) -> float | None:
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return data[1] / 1e9 if data else 0.0

    def finish(self) -> None:
        if self.options is not None and self.options.debug_metrics and self.is_main:
            import torch_xla.debug.metrics as met

            print(met.metrics_report())


def xla_metrics() -> dict[str, float]:
    """Compile count/time, CPU fallbacks and transfers from torch_xla's metrics."""
    import torch_xla.debug.metrics as met

    compile_data = met.metric_data("CompileTime")
    to_device = met.metric_data("TransferToDeviceTime")
    from_device = met.metric_data("TransferFromDeviceTime")
    fallbacks = [name for name in met.counter_names() if name.startswith("aten::")]
    return {
        "xla/compiles": float(compile_data[0]) if compile_data else 0.0,
        "xla/compile_seconds": compile_data[1] / 1e9 if compile_data else 0.0,
        "xla/fallback_ops": float(sum(met.counter_value(name) or 0 for name in fallbacks)),
        "xla/transfers_to_device": float(to_device[0]) if to_device else 0.0,
        "xla/transfers_from_device": float(from_device[0]) if from_device else 0.0,
    }


def static_experts(model: nn.Module) -> None:
    """A Transformers mixture-of-experts model's experts computed in fixed shapes (every token's
    chosen experts' weights gathered: ``batched_mm``), for one graph a step: its default kernels
    count the tokens of each expert (``histc``, ``nonzero``), a host sync that XLA cannot trace."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) not in (None, "batched_mm"):
        model.set_experts_implementation("batched_mm")


def moved_tied(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)`` with its tied parameters tied again: a move to an XLA device makes each
    parameter a tensor of its own, and a tied output layer would then train apart from its embedding."""
    shared: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in model.modules():
        for name, param in owner.named_parameters(recurse=False):
            shared.setdefault(id(param), []).append((owner, name))
    model = model.to(device)
    for places in shared.values():
        first_owner, first_name = places[0]
        for owner, name in places[1:]:
            setattr(owner, name, getattr(first_owner, first_name))
    return model
