"""The native stack (cpu, cuda, TorchTPU) with the model sharded over the workers: FSDP2
(``torch.distributed.fsdp.fully_shard``); and what any sharding (FSDP2, and FSDPv2 on xla) shards
unit by unit.

Each unit (``sharding.layers``, by default the decoder layers a Transformers model names in
``_no_split_modules``) is sharded on its own, then the root, as torchtitan and Accelerate's
``fsdp_version: 2`` do: a unit's weights are gathered for its forward and backward and freed
after, so a worker holds one unit whole at a time and its own shard of everything else
(parameters, gradients, optimizer state). The model is placed on the device unit by unit, each
sharded before the next moves, so that no worker ever holds the whole fp32 model there (as
torchtitan's meta-device initialisation avoids it). Parameter names stay the plain model's: FSDP2 swaps
parameters for DTensors in place, and activation checkpointing (non-reentrant, inside each unit's
gather) and regional compilation work in place too.

On cuda with bf16, parameters are gathered and computed in bf16 and gradients reduced in fp32
(``MixedPrecisionPolicy``); the optimizer steps the fp32 shards.

The unit is named by class (``sharding.layers``), as Transformers'
``fsdp_config["transformer_layer_cls_to_wrap"]`` does, and defaults to the classes a Transformers
model declares in ``_no_split_modules`` (the same default as Transformers' Trainer and Accelerate).
FSDPv2's wrapper keeps its module as ``_orig_module``, which would put ``_orig_module.`` into every
parameter name under it: :func:`plain_state_dict_names` hides it, so that a checkpoint of a
sharded run has the plain model's names (it loads into an unwrapped model and back).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from raytpu.console import muted_stdout
from raytpu.errors import ConfigError
from raytpu.job import empty_build, weight_files_of
from raytpu.parallel.mesh import MeshShape, resolve_mesh
from raytpu.parallel.reading import ShardedWeights
from raytpu.parallel.tensor import parallelize
from raytpu.runtime.base import Runtime
from raytpu.runtime.compiled import compile_regions, compile_whole
from raytpu.runtime.torch_ddp import DDPRuntime, refresh_float8_scales


def native_runtime(
    name: str, device_type: str, precision: str, world: int, rank: int, local_rank: int, options: dict[str, Any]
) -> Runtime:
    """The native PyTorch stack on ``device_type`` (cpu, cuda, TorchTPU's tpu): DDP, or FSDP2 when
    the plan shards; ``options`` as :meth:`raytpu.runtime.kinds.RuntimeKind.make` gets them."""
    sharding, compile_mode, tf32 = options.get("sharding"), options.get("compile_mode", ""), options.get("tf32", True)
    recipe = options.get("fp8_recipe", "tensorwise")
    if sharding is not None and sharding.strategy != "none":
        return FSDPRuntime(name, precision, world, rank, local_rank, compile_mode, tf32, sharding, device_type, recipe)
    return DDPRuntime(name, precision, world, rank, local_rank, compile_mode, tf32, device_type, recipe)


def fsdp2_settings(cfg: Any, precision: str) -> dict[str, Any]:
    """``sharding`` on the native stack: FSDP2, which computes in bf16 or fp32 and keeps no EMA copy
    of a sharded model (a ConfigError for either). The mesh is over the workers: a tensor axis or an
    fsdp axis of more than one worker shards (FSDP2 over the fsdp axis, tensor parallelism inside each
    group of the tensor axis, the fsdp axis taking the workers the tensor axis leaves), ``full_shard``
    alone puts every worker on the fsdp axis."""
    mesh = cfg.sharding.mesh
    values: dict[str, Any] = {}
    if cfg.sharding.strategy == "none" and mesh.fsdp == 1 and mesh.tensor == 1:
        return {}
    if mesh.fsdp == 1 and mesh.data == -1:
        values["sharding.mesh.fsdp"] = -1
    shape = resolve_mesh(
        cfg.scaling.num_workers,
        1 if mesh.data == -1 else mesh.data,
        values.get("sharding.mesh.fsdp", mesh.fsdp),
        mesh.tensor,
        "workers (scaling.num_workers)",
    )
    if shape.data > 1:
        raise ConfigError(
            f"sharding.mesh {shape.describe()}: on cpu and cuda a sharded run's workers are all on its fsdp and "
            "tensor axes (replicas of a sharded model, HSDP, are not offered): set sharding.mesh.data=1"
        )
    if shape.tensor > 1 and (cfg.scaling.min_workers or precision == "fp8"):
        why = "an elastic range of workers" if cfg.scaling.min_workers else "scaling.precision=fp8"
        raise ConfigError(f"sharding.mesh.tensor={shape.tensor} with {why} is not offered: set sharding.mesh.tensor=1")
    values["sharding.strategy"] = "full_shard"
    if precision == "fp16":
        raise ConfigError(
            "sharding.strategy=full_shard computes in bf16 or fp32, and this GPU has no bf16: set "
            "scaling.precision=fp32"
        )
    if cfg.loop.ema_beta:
        raise ConfigError(
            "loop.ema_beta: an EMA copy of a sharded model is not kept; set loop.ema_beta=0 or sharding.strategy=none"
        )
    return values


class FSDPRuntime(DDPRuntime):
    sharded = True

    def __init__(
        self,
        name: str,
        precision: str,
        world_size: int,
        rank: int,
        local_rank: int,
        compile_mode: str = "",
        tf32: bool = True,
        sharding: Any = None,
        device_type: str = "",
        fp8_recipe: str = "tensorwise",
    ) -> None:
        super().__init__(name, precision, world_size, rank, local_rank, compile_mode, tf32, device_type, fp8_recipe)
        self.layers = list(sharding.layers) if sharding else []
        self.activation_checkpointing = bool(sharding and sharding.activation_checkpointing)
        self.scaler = None  # the plan allows bf16 and fp32 only: no loss scaling
        self.units = 0
        self.shape = worker_mesh(sharding, world_size)
        self.tensor_parallel_layers = 0
        self.weights: ShardedWeights | None = None  # each rank reads its shards of pretrained weights
        self.float8_model: nn.Module | None = None  # fp8 whose weights are gathered in float8: scales to refresh

    def build(self, make: Callable[[], nn.Module]) -> nn.Module:
        """Every rank builds the model on the meta device (a job that reads pretrained weights builds
        the same architecture from its config: ``raytpu.job.empty_build``). Where each can read its
        own shards of the pretrained weights (:mod:`raytpu.parallel.reading`), that is all; else rank 0
        builds it whole, and every rank starts from rank 0's weights and buffers, sent unit by unit as
        each is sharded (:meth:`prepare_model`), as Accelerate's ``cpu_ram_efficient_loading`` does.
        Either way the workers of a node never hold as many whole copies."""
        if self.world_size == 1:
            return make()
        with empty_build():
            model = make()
        self.weights = self._reading(model)
        if self.weights is None:
            return make() if self.rank == 0 else model
        # built again, with the buffers it computes as it is built (in no file): the meta build above
        # makes no parameter on the CPU, which would leave glibc's heap grown for the fallback's ranks
        with empty_build(real_buffers=True):
            model = make()
        if callable(getattr(model, "tie_weights", None)):  # made anew on the meta device, a tie came apart
            model.tie_weights()
        return model

    def _reading(self, model: nn.Module) -> ShardedWeights | None:
        """How the ranks read their shards of ``model``'s pretrained weights, if every rank can."""
        files = weight_files_of(model)
        alone = self.shape.tensor == 1 and self.precision != "fp8"  # split or converted layers: rank 0's
        weights = ShardedWeights.of(model, files()) if files is not None and alone else None
        everywhere = torch.tensor([weights is not None], dtype=torch.int32, device=self.collective_device)
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
        return weights if everywhere.item() else None

    def prepare_model(
        self, model: nn.Module, find_unused_parameters: bool = False, sync_batchnorm: str = "auto"
    ) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self._mesh()
        gather = self.fp8_recipe == "tensorwise" and self.device.type == "cuda"  # NCCL gathers float8; gloo cannot
        self.use_float8(model, gather_in_float8=gather)
        self.float8_model = model if gather and self.float8_layers else None
        if self.shape.tensor > 1:  # split each layer over its tensor group first, as torchtitan does, then shard
            place(model, self.device)
            self._same_start([*model.parameters(), *model.buffers()])
            self.tensor_parallel_layers = parallelize(model, mesh["tensor"])
            mesh = mesh["fsdp"]
        units = units_of(model, wrapping_units(model, self.layers))
        if self.activation_checkpointing:
            if not units:
                raise ValueError(NO_UNITS)
            for unit in units:
                checkpoint_in_place(unit)
        if self.compile_mode and compile_regions(model, self.compile_mode):
            self.compiled = "regional"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        options = {"mesh": mesh, "mp_policy": policy} if self.precision in ("bf16", "fp8") else {"mesh": mesh}
        for unit in units:  # one unit whole on the device at a time, never the whole model
            if self.weights is None:  # else sharded on the meta device, each rank to read its shards
                place(unit, self.device)
            if self.weights is None and not self.tensor_parallel_layers:  # else rank 0's weights are everywhere
                self._same_start([*unit.parameters(), *unit.buffers()])
            for part in apart(unit):  # FSDP2 gathers one dtype a group: fp32 adapters on a bf16 base, their own
                fully_shard(part, **options)
            fully_shard(unit, **options)
        if self.weights is None:
            place(model, self.device)  # what no unit holds: the sharded units' DTensors stay as they are
            self._same_start(
                [tensor for tensor in [*model.parameters(), *model.buffers()] if not isinstance(tensor, DTensor)]
            )
        fully_shard(model, **options)
        if self.weights is not None:
            self.weights.fill(model, self.device)
            self._same_start(list(model.buffers()))  # as built on every rank: the check that the models match
        self.units = len(units)
        if self.compile_mode and not self.compiled:
            model, self.compiled = compile_whole(model, self.compile_mode), "whole"
        return model

    def _mesh(self) -> Any:
        """The workers as FSDP2's one-dimensional mesh, or as a (fsdp, tensor) mesh: consecutive ranks
        form a tensor group (on a GPU node, the GPUs of one node). One worker alone (a local run of one
        process) gets a process group of its own, so that it shards as a larger run would."""
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            backend = {"cuda": "nccl", "tpu": "tpu_dist"}.get(self.device.type, "gloo")
            with muted_stdout():  # gloo's "[Gloo] Rank 0 is connected to 0 peer ranks"
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        if self.shape.tensor > 1:
            return init_device_mesh(
                self.device.type, (self.shape.fsdp, self.shape.tensor), mesh_dim_names=("fsdp", "tensor")
            )
        return init_device_mesh(self.device.type, (self.world_size,))

    @property
    def data_parallel_size(self) -> int:
        """A tensor group's workers read the same samples: the batch splits over the fsdp axis."""
        return self.world_size // self.shape.tensor

    @property
    def data_parallel_rank(self) -> int:
        return self.rank // self.shape.tensor

    def all_reduce_sum(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sums over the data-parallel shares: each tensor group's workers evaluated the same samples."""
        summed = super().all_reduce_sum(totals)
        return {key: value / self.shape.tensor for key, value in summed.items()}

    @torch.no_grad()
    def _same_start(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's initial weights and buffers (``tensors``, on the device) on every rank, as DDP gives
        them: each rank seeds its own random streams, and each keeps its own slice of what it holds
        once the module is sharded. Ranks whose models differ are an error, never a wait."""
        if self.world_size == 1:
            return
        shape = torch.tensor([len(tensors), sum(t.numel() for t in tensors)], device=self.collective_device)
        lowest, highest = shape.clone(), shape.clone()
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX)
        if not torch.equal(lowest, highest):
            raise RuntimeError(
                f"rank {self.rank} built a model of {int(shape[0])} tensors ({int(shape[1])} values) and another "
                f"rank one of {int(lowest[0])}-{int(highest[0])}: the job's build_model must build the same model on "
                "every rank"
            )
        for tensor in tensors:
            dist.broadcast(tensor.data, src=0)

    def track_unused_parameters(self, model: nn.Module, unused: bool) -> nn.Module:
        """FSDP2 reduces every parameter's gradient, used or not: nothing to look for."""
        return model

    def no_sync(self, model: nn.Module, skip: bool) -> contextlib.AbstractContextManager:
        """FSDP2 reduce-scatters in the backward that follows this forward unless told not to; the
        flag stays until the next micro-step sets it, so it holds for the backward after the context."""
        unwrapped = self.unwrap(model)
        if hasattr(unwrapped, "set_requires_gradient_sync"):
            unwrapped.set_requires_gradient_sync(not skip)
        return contextlib.nullcontext()

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float, measure: bool = True
    ) -> torch.Tensor | None:
        norm = sharded_clip_or_measure(params, max_norm, measure)
        optimizer.step()
        if self.float8_model is not None:
            refresh_float8_scales(self.float8_model)
        return norm

    def even_batches(self, batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
        """Every rank runs as many forwards as the rank with the most batches (each gathers weights
        from all ranks): a rank out of batches repeats its last one, uncounted."""
        last = None
        source = iter(batches)
        while True:
            batch = next(source, None)
            more = torch.tensor([0.0 if batch is None else 1.0], device=self.collective_device)
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if not more.item():
                return
            if batch is None and last is None:
                raise RuntimeError(
                    f"rank {self.rank} has no evaluation batch while others have: give the split at least one "
                    "batch per worker (a smaller data.eval_batch_size)"
                )
            if batch is not None:
                last = batch
            yield last, batch is not None


def apart(unit: nn.Module) -> list[nn.Module]:
    """The modules of ``unit`` whose own parameters are in another dtype than most of the unit's
    (LoRA adapters trained in fp32 on a frozen bf16 base), sharded as groups of their own."""
    sizes: dict[torch.dtype, int] = {}
    for param in unit.parameters():
        sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    if len(sizes) < 2:
        return []
    main = max(sizes, key=sizes.__getitem__)
    return [
        module
        for module in unit.modules()
        if module is not unit and any(p.dtype != main for p in module.parameters(recurse=False))
    ]


def place(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)``, where a parameter or buffer built on the meta device
    (:meth:`FSDPRuntime.build`) is made there empty first, for rank 0's values to fill; a tied
    parameter stays one."""
    made: dict[int, torch.Tensor] = {}
    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if param.is_meta:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
                setattr(owner, name, made[id(param)])
        for name, buffer in list(owner.named_buffers(recurse=False)):
            if buffer.is_meta:
                owner._buffers[name] = torch.empty_like(buffer, device=device)
    module.to(device)


def worker_mesh(sharding: Any, world_size: int) -> MeshShape:
    """The workers' mesh as the plan resolved it (``fsdp2_settings``): the fsdp axis takes the
    workers the tensor axis leaves, at whatever size the group started (an elastic run's)."""
    mesh = getattr(sharding, "mesh", None)
    tensor = mesh.tensor if mesh is not None else 1
    fsdp = mesh.fsdp if mesh is not None and tensor == -1 else -1
    return resolve_mesh(world_size, 1, fsdp, tensor, "workers")


def checkpoint_in_place(unit: nn.Module) -> None:
    """Recompute ``unit``'s activations in the backward (non-reentrant ``torch.utils.checkpoint``),
    without a wrapper module: parameter names stay plain, and FSDP2's hooks on the unit still
    gather its weights around the recomputation."""
    unit.forward = functools.partial(checkpoint, unit.forward, use_reentrant=False)


def sharded_clip_or_measure(params: list[nn.Parameter], max_norm: float, measure: bool) -> torch.Tensor | None:
    """:func:`raytpu.runtime.base.clip_or_measure` over sharded gradients: each rank's partial norm
    reduced into the global one (a collective: every rank calls it at the same steps). Gradients
    on different meshes (a tensor-parallel layer's on (fsdp, tensor), a norm's on fsdp alone) are
    measured mesh by mesh, the norms then combined."""
    if not (max_norm > 0 or measure):
        return None
    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for param in params:
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    norms = []
    for group in by_mesh.values():
        partial = torch.nn.utils.get_total_norm([param.grad for param in group], foreach=None)
        norms.append(partial.full_tensor() if isinstance(partial, DTensor) else partial)
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=None)
    return norm


# ------------------------------------------------------------------ the units any sharding shards (FSDP2 and FSDPv2)
WRAPPED = "_orig_module."

NO_UNITS = (
    "sharding.activation_checkpointing checkpoints the model's repeated blocks, and this model declares "
    "none: set sharding.layers to their class names"
)


def wrapping_units(model: nn.Module, class_names: list[str]) -> set[type[nn.Module]]:
    """The module classes wrapped one by one: ``class_names`` (``sharding.layers``), else the
    model's ``_no_split_modules``; empty when neither names any (the whole model is one unit)."""
    names = list(class_names) or list(getattr(model, "_no_split_modules", None) or [])
    classes = {type(module).__name__: type(module) for module in model.modules()}
    missing = [name for name in names if name not in classes]
    if missing:
        known = ", ".join(sorted(name for name in classes if name != type(model).__name__)[:12])
        raise ValueError(
            f"sharding.layers: the model has no module of class {', '.join(missing)}; its module classes "
            f"include {known}"
        )
    return {classes[name] for name in names}


def units_of(model: nn.Module, units: set[type[nn.Module]]) -> list[nn.Module]:
    """The model's modules of the unit classes, outermost only (a unit inside a unit is not one)."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, tuple(units)) and module is not model:
            found.append(module)
            inside.update(id(child) for child in module.modules())
    return found


def plain_state_dict_names(wrapper: nn.Module) -> None:
    """Save ``wrapper``'s entries without its ``_orig_module.`` and load plain names into it."""
    wrapper.register_state_dict_post_hook(_drop_wrapper_name)
    wrapper.register_load_state_dict_pre_hook(_add_wrapper_name)


def _drop_wrapper_name(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    _rename(state_dict, prefix + WRAPPED, prefix)


def _add_wrapper_name(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:  # (local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    plain = [key for key in state_dict if key.startswith(prefix) and not key.startswith(prefix + WRAPPED)]
    if plain:
        _rename(state_dict, prefix, prefix + WRAPPED, only=set(plain))


def _rename(state_dict: dict[str, Any], old: str, new: str, only: set[str] | None = None) -> None:
    """Replace the leading ``old`` of keys by ``new``, in place, keeping the entries' order."""
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        if key.startswith(old) and (only is None or key in only):
            key = new + key[len(old) :]
        state_dict[key] = value
