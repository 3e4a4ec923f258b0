"""cpu and cuda runtimes: PyTorch DDP (gloo on CPU, NCCL on GPU), AMP and TF32 on GPU,
``torch.compile`` when the plan asks for it (``raytpu.runtime.compiled``), and float8 training.

float8 (``scaling.precision: fp8``): every ``nn.Linear`` whose two dimensions are multiples of 16
(what float8 matmuls take) becomes torchao's ``Float8Linear``, as torchtitan trains Llama on H100s,
except the output head (a Transformers model's output embeddings, else the model's last linear
layer), which decides the loss and gains little. The rest of the model computes in bf16 under
autocast, and the float8 layers keep their weights in fp32 under the same parameter names: a
checkpoint of an fp8 run loads into a bf16 or fp32 model, and back. ``scaling.fp8_recipe``:
``tensorwise``, one scale per tensor, the faster, which under FSDP2 on GPUs also gathers the
weights in float8; ``rowwise``, one scale per row, the more accurate.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce
from torch.nn.parallel import DistributedDataParallel

from raytpu.errors import install_hint
from raytpu.runtime.base import Runtime, batchnorm_scope, check_float8, clip_or_measure, gpu_peak_flops
from raytpu.runtime.compiled import CompileWatch, compile_regions, compile_whole
from raytpu.runtime.tpu import tpu_peak_flops


class DDPRuntime(Runtime):
    def __init__(
        self,
        name: str,
        precision: str,
        world_size: int,
        rank: int,
        local_rank: int,
        compile_mode: str = "",
        tf32: bool = True,
        device_type: str = "",
        fp8_recipe: str = "tensorwise",
    ) -> None:
        """``compile_mode``: torch.compile's mode, or "" for eager; ``tf32``: TF32 tensor cores for
        what stays fp32 on a GPU (matmuls and convolutions outside autocast); ``device_type``: cpu,
        cuda or tpu ("": the runtime's name says, cuda or cpu); ``fp8_recipe``: the float8 layers'
        scaling when ``precision`` is fp8 (the module docstring)."""
        super().__init__(precision, world_size, rank, local_rank)
        self.name, self.compile_mode, self.fp8_recipe = name, compile_mode, fp8_recipe
        self.float8_layers: list[str] = []
        self.watch = CompileWatch() if compile_mode else None
        self.compiled = ""  # how the model was compiled: regional | whole
        os.environ["USE_TORCH_XLA"] = "0"  # Transformers would otherwise import torch_xla when it is installed
        device_type = device_type or ("cuda" if name == "cuda" else "cpu")
        if device_type == "cuda":
            self.device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(self.device)
            torch.set_float32_matmul_precision("high" if tf32 else "highest")
            torch.backends.cudnn.allow_tf32 = tf32
            if precision == "fp8":
                check_float8(self.device)
        elif device_type != "cpu":  # one chip a worker: the one Ray made visible to this process
            self.device = torch.device(device_type, 0)
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" and device_type == "cuda" else None

    def prepare_model(
        self, model: nn.Module, find_unused_parameters: bool = False, sync_batchnorm: str = "auto"
    ) -> nn.Module:
        model = model.to(self.device)
        self.use_float8(model)
        if batchnorm_scope(self.name, sync_batchnorm, False, self.world_size) == "global" and self.world_size > 1:
            if self.device.type == "cuda":
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            else:
                model = convert_to_global_batchnorm(model)
        if self.compile_mode and compile_regions(model, self.compile_mode):
            self.compiled = "regional"
        if self.world_size > 1 and dist.is_initialized():
            model = self._wrap(model, find_unused_parameters)
        if self.compile_mode and not self.compiled:
            model, self.compiled = compile_whole(model, self.compile_mode), "whole"
        return model

    def use_float8(self, model: nn.Module, gather_in_float8: bool = False) -> None:
        """fp8: the model's linear layers to float8 (before it is compiled, wrapped or sharded)."""
        if self.precision == "fp8":
            self.float8_layers = convert_to_float8(model, self.fp8_recipe, gather_in_float8)

    def _wrap(self, module: nn.Module, unused: bool) -> DistributedDataParallel:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, find_unused_parameters=unused)

    def track_unused_parameters(self, model: nn.Module, unused: bool) -> nn.Module:
        compiled = self.compiled == "whole"
        wrapper = model._orig_mod if compiled else model
        if isinstance(wrapper, DistributedDataParallel) and wrapper.find_unused_parameters != unused:
            rewrapped = self._wrap(wrapper.module, unused)
            return compile_whole(rewrapped, self.compile_mode) if compiled else rewrapped
        return model

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float, measure: bool = True
    ) -> torch.Tensor | None:
        if self.scaler is None:
            return super().optimizer_step(optimizer, params, max_norm, measure)
        self.scaler.unscale_(optimizer)
        norm = clip_or_measure(params, max_norm, measure)
        self.scaler.step(optimizer)
        self.scaler.update()
        return norm

    def begin_step(self, step: int) -> None:
        if self.watch is not None:
            self.watch.begin_step()

    def end_step(self, step: int, steps_into_epoch: int) -> str | None:
        """A step past the first two of an epoch (the first compiles the step, the second sees the
        optimizer state it made) must reuse its graphs; one that compiles is named, with Dynamo's reason."""
        return self.watch.end_step(step, warm=steps_into_epoch >= 2) if self.watch is not None else None

    def metrics(self) -> dict[str, float]:
        return {"compile/recompiles_after_warmup": float(self.watch.recompiles)} if self.watch is not None else {}

    def compile_seconds(self) -> float | None:
        return self.watch.seconds() if self.watch is not None else None

    @property
    def fused_optimizer(self) -> bool:
        """cuda and the CPU (where the fused kernel steps AdamW ~3.5x faster than the foreach one:
        as Transformers' default ``adamw_torch_fused``)."""
        return self.device.type in ("cuda", "cpu")

    @property
    def collective_device(self) -> torch.device:
        return self.device

    @property
    def pin_memory(self) -> bool:
        return self.device.type == "cuda"

    def device_kind(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        if self.device.type == "tpu":
            return os.environ.get("TPU_ACCELERATOR_TYPE", "tpu")
        return "cpu"

    def device_peak_flops(self) -> float | None:
        if self.device.type == "cuda":
            return gpu_peak_flops(self.device_kind())
        return tpu_peak_flops(self.device_kind()) if self.device.type == "tpu" else None

    def rng_state(self) -> dict[str, Any]:
        state = super().rng_state()
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        super().set_rng_state(state)
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def scaler_state(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_scaler_state(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


# ------------------------------------------------------------------ BatchNorm over the global batch on CPUs
class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm layer whose training statistics are those of the batch over all workers.

    Same parameters and buffers as ``nn.BatchNorm{1,2,3}d`` (state dicts are interchangeable);
    in eval mode, or without a process group of several workers, it is a plain BatchNorm.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input, got {input.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        count = torch.full((1,), x.numel() / channels, dtype=x.dtype, device=x.device)
        sums = all_reduce(torch.cat([x.sum(dims), (x * x).sum(dims), count]))
        total = sums[-1]
        mean = sums[:channels] / total
        var = (sums[channels : 2 * channels] / total - mean * mean).clamp_min(0)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), float(total.detach()))
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        self.num_batches_tracked += 1
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = var * count / max(count - 1, 1)
        self.running_mean.lerp_(mean, momentum)
        self.running_var.lerp_(unbiased, momentum)


def convert_to_global_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every ``nn.BatchNorm*d`` in ``module`` by a :class:`GlobalBatchNorm` with the same state."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, GlobalBatchNorm):
        converted = GlobalBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        converted.load_state_dict(module.state_dict())
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        module.add_module(name, convert_to_global_batchnorm(child))
    return module


# ------------------------------------------------------------------ float8 (scaling.precision: fp8)
#: what a matmul in float8 needs of a layer's dimensions
MULTIPLE = 16


def output_head(model: nn.Module) -> nn.Module | None:
    """The layer that makes the model's outputs: a Transformers model's output embeddings, else its
    last ``nn.Linear`` (None: it has none)."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is not None:
        return head
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    return linears[-1] if linears else None


def float8_layers(model: nn.Module) -> list[str]:
    """The names of the linear layers fp8 computes in float8 (see the module docstring)."""
    head = output_head(model)
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and module is not head
        and module.in_features % MULTIPLE == 0
        and module.out_features % MULTIPLE == 0
    ]


def convert_to_float8(model: nn.Module, recipe: str, gather_in_float8: bool = False) -> list[str]:
    """Swap the :func:`float8_layers` of ``model`` for torchao's ``Float8Linear`` in place (before
    compiling and sharding it); ``gather_in_float8``: FSDP2 all-gathers their weights in float8
    (``tensorwise`` only). Returns the layers converted."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise RuntimeError(
            f"scaling.precision=fp8 computes linear layers in float8 with torchao, which does not load here ({exc}): "
            f"{install_hint('fp8')}"
        ) from None
    chosen = set(float8_layers(model))
    config = Float8LinearConfig.from_recipe_name(recipe)
    if gather_in_float8 and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name in chosen)
    return sorted(chosen)


def refresh_float8_scales(model: nn.Module) -> None:
    """After an optimizer step of a model whose float8 weights FSDP2 gathers: their scales for the
    next step, computed for all layers at once (torchao's one all-reduce instead of one a layer)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
