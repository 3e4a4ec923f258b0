"""Optimizers, learning-rate schedules, an XLA-friendly EMA of the weights, and the weight of each
micro-batch's loss in a step whose loss averages over items that vary in number
(:class:`raytpu.job.AveragesOverItems`: a fine-tuning batch's trained tokens).

Each worker's loss is the mean over its batch's items, and the data-parallel wrappers average the
gradients over the workers; a step of ``accum`` micro-batches averaged those means again: a mean of
means, which counts an item of a short batch more than one of a long batch. Weighting micro-batch
``i`` of a worker by ``n_i x workers / N`` (``n_i`` its items, ``N`` the items of the whole step on
every worker) makes the step's gradient that of the mean over all ``N`` items, as Transformers'
Trainer computes it (``num_items_in_batch``, summed over devices). The count ``N`` is one small
all-reduce per step. A static-graph runtime (XLA) with several workers keeps the mean of means: the
count would be a second graph or a read back each step.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from raytpu.config import ConfigError, LoopSettings, OptimSettings
from raytpu.config.training_args import warmup_steps
from raytpu.errors import install_hint
from raytpu.job import AveragesOverItems, Batch, Job
from raytpu.runtime import Runtime


def build_optimizer(cfg: OptimSettings, model: nn.Module, fused: bool = False) -> torch.optim.Optimizer:
    """The optimizer of ``cfg`` over ``model``'s trainable parameters, weight decay kept off biases
    and normalisation weights (:func:`decay_groups`); ``fused``: Adam and AdamW in PyTorch's fused
    kernel (cuda, cpu)."""
    params = decay_groups(model, cfg.weight_decay)
    if cfg.name == "adafactor":
        try:
            from transformers.optimization import Adafactor
        except ImportError as exc:
            raise ConfigError(f"optim.name=adafactor is Transformers' Adafactor: {install_hint('lm')}") from exc

        # what TrainingArguments(optim="adafactor") builds: the given lr, no relative step or scaling
        return Adafactor(params, lr=cfg.lr, scale_parameter=False, relative_step=False)
    if cfg.name == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.lr)
    adam = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps, "fused": fused or None}
    if cfg.name == "adam":
        return torch.optim.Adam(params, **adam)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, **adam)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)


#: module classes whose weights are normalisation gains (never decayed), besides any class whose
#: name ends in ``Norm`` (``LlamaRMSNorm``, ``T5LayerNorm``)
NORMALISATIONS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm)


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in two groups, as Transformers' Trainer makes them: biases and the
    weights of normalisation layers without weight decay (and a weight that says it takes none: the
    stacked norms of scanned layers, ``raytpu.parallel.scan``), the rest with ``weight_decay`` (one group
    when there is no decay, so that the optimizer state of such a run keeps its layout)."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        normalisation = isinstance(module, NORMALISATIONS) or type(module).__name__.endswith("Norm")
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            exempt = normalisation or "bias" in name or getattr(param, "no_weight_decay", False)  # a stacked norm's
            (no_decay if exempt else decay).append(param)
    if not weight_decay:
        return [{"params": decay + no_decay, "weight_decay": 0.0}]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def base_lr_at(cfg: OptimSettings, step: int) -> float:
    """The base lr at ``step``: ``optim.lr``, or the last of ``optim.lr_changes`` at or before it."""
    reached = [changed for changed in cfg.lr_changes if int(changed) <= step]
    return float(cfg.lr_changes[max(reached, key=int)]) if reached else cfg.lr


def lr_factor(cfg: OptimSettings, total_steps: int) -> Callable[[int], float]:
    """Multiplier of ``optim.lr`` at a step: the base lr's changes, linear warm-up, then the
    schedule's shape."""

    warmup = warmup_steps(cfg.warmup_steps, cfg.warmup_ratio, total_steps)

    def factor(step: int) -> float:
        return base_lr_at(cfg, step) / cfg.lr * shape_at(step)

    def shape_at(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.scheduler == "constant":
            return 1.0
        span = max(total_steps - warmup, 1)
        progress = min(max(step - warmup, 0) / span, 1.0)
        shape = {
            "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
            "linear": 1 - progress,
            "poly": (1 - progress) ** 0.9,
        }[cfg.scheduler]
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape

    return factor


def build_scheduler(
    cfg: OptimSettings, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, total_steps))


def keep_configured_lr(optimizer: torch.optim.Optimizer, scheduler: Any, base_lrs: list[float]) -> None:
    """After a resume: the base lrs the run is configured with (a checkpoint saves its own, and a
    population-based sweep's trial resumes another trial's checkpoint with a perturbed lr), the
    current lr recomputed from them at the restored step."""
    scheduler.base_lrs = list(base_lrs)
    for group, base, factor in zip(optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


@dataclass(frozen=True)
class EMASchedule:
    """How much of the current weights each training step mixes into the EMA.

    The step counter is ``ema_pytorch``'s (the schedule CDEIT's authors train with): an update
    is due every ``every`` steps; up to ``update_after`` steps it copies the weights; then, with
    ``warmup``, the decay ramps as ``1 - (1 + n) ** -power`` (n = steps past ``update_after + 1``)
    up to ``beta``, so that a short run's EMA follows its weights instead of the initial ones;
    without it the decay is ``beta`` at once.
    """

    beta: float
    every: int = 1
    update_after: int = 0
    warmup: bool = False
    power: float = 2 / 3

    @classmethod
    def from_loop(cls, loop: LoopSettings) -> EMASchedule:
        return cls(loop.ema_beta, loop.ema_every, loop.ema_update_after, loop.ema_warmup, loop.ema_power)

    def decay(self, step: int) -> float:
        """The decay of an update at ``step`` (0-based, counting every training step); 0 = copy."""
        if step <= self.update_after:
            return 0.0
        if not self.warmup:
            return self.beta
        past = step - self.update_after - 1
        return 0.0 if past <= 0 else min(1.0 - (1.0 + past) ** -self.power, self.beta)

    def weight(self, step: int) -> float:
        """The weight of the current weights in the EMA after ``step``: 0 when no update is due."""
        return 0.0 if step % self.every else 1.0 - self.decay(step)


class EMA:
    """Exponential moving average of a model's weights.

    ``torch.optim.swa_utils.AveragedModel`` branches on a tensor in its update,
    a host sync on XLA; this one is a plain ``lerp``. With a tensor ``weight``
    (0 on steps that skip the update) every step runs the same graph on XLA.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module, weight: float | torch.Tensor) -> None:
        """``ema += weight * (model - ema)`` for every parameter; buffers are copied."""
        ema_params = list(self.model.parameters())
        params = [p.detach() for p in model.parameters()]
        if isinstance(weight, torch.Tensor):
            for ema_param, param in zip(ema_params, params):
                ema_param.lerp_(param, weight)
        else:
            torch._foreach_lerp_(ema_params, params, weight)
        for ema_buffer, buffer in zip(self.model.buffers(), model.buffers()):
            ema_buffer.copy_(buffer)

    def step(self, model: nn.Module, weight: float, static_graph: bool, device: torch.device) -> None:
        """A training step's update (``weight`` 0: none is due). On a static-graph runtime (XLA)
        every step updates, with the weight as a tensor input of the graph (0 when not due), so
        that one compiled step serves every step of the schedule. It travels as a 1-element
        tensor: torch_xla bakes a 0-d tensor holding 0 or 1 into the graph as a constant, which
        would compile the copy and skip steps apart from the ramped ones."""
        if static_graph:
            self.update(model, torch.tensor([weight]).to(device).reshape(()))
        elif weight:
            self.update(model, weight)


# ------------------------------------------------------------------ a step's loss over varying items
def weighs_items(job: Job, runtime: Runtime, accum: int) -> bool:
    """Whether a step's micro-batches are weighted: the job's loss averages over varying items, and
    the step has several micro-batches or workers to average over (one worker on a static graph)."""
    if not isinstance(job, AveragesOverItems) or (accum == 1 and runtime.data_parallel_size == 1):
        return False
    return not (runtime.static_graph and runtime.world_size > 1)


def loss_scales(job: Job, runtime: Runtime, batches: list[Batch]) -> tuple[Iterator[Batch], list[torch.Tensor] | None]:
    """The step's micro-batches again, and each one's factor on its loss (None where the job counts
    no items in them)."""
    counts = [job.loss_items(batch) for batch in batches]
    if any(count is None for count in counts):
        return iter(batches), None
    local = torch.stack([count.float() for count in counts])
    total = local.sum()
    workers = runtime.data_parallel_size
    if workers > 1:
        total = runtime.all_reduce_sum({"items": total})["items"].to(local.device, local.dtype)
    return iter(batches), list(local * workers / total.clamp_min(1))
