"""cpu and cuda runtimes: PyTorch DDP (gloo on CPU, NCCL on GPU), AMP and TF32 on GPU, and
``torch.compile`` when the plan asks for it (``raytpu.runtime.compiled``)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytpu.runtime.base import Runtime, batchnorm_scope, clip_or_measure
from raytpu.runtime.batchnorm import convert_to_global_batchnorm
from raytpu.runtime.compiled import CompileWatch, compile_regions, compile_whole
from raytpu.runtime.peaks import gpu_peak_flops


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
    ) -> None:
        """``compile_mode``: torch.compile's mode, or "" for eager; ``tf32``: TF32 tensor cores for
        what stays fp32 on a GPU (matmuls and convolutions outside autocast)."""
        super().__init__(precision, world_size, rank, local_rank)
        self.name, self.compile_mode = name, compile_mode
        self.watch = CompileWatch() if compile_mode else None
        self.compiled = ""  # how the model was compiled: regional | whole
        os.environ["USE_TORCH_XLA"] = "0"  # Transformers would otherwise import torch_xla when it is installed
        if name == "cuda":
            self.device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(self.device)
            torch.set_float32_matmul_precision("high" if tf32 else "highest")
            torch.backends.cudnn.allow_tf32 = tf32
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    def prepare_model(
        self, model: nn.Module, find_unused_parameters: bool = False, sync_batchnorm: str = "auto"
    ) -> nn.Module:
        model = model.to(self.device)
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

    def begin_step(self) -> None:
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
        return self.device.type == "cuda"

    @property
    def collective_device(self) -> torch.device:
        return self.device

    @property
    def pin_memory(self) -> bool:
        return self.device.type == "cuda"

    def device_kind(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def device_peak_flops(self) -> float | None:
        return gpu_peak_flops(self.device_kind()) if self.device.type == "cuda" else None

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
