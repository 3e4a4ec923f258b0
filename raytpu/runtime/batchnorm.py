"""BatchNorm over the global batch on CPU workers (``loop.sync_batchnorm``).

PyTorch's ``SyncBatchNorm`` refuses CPU tensors, so DDP over gloo normalises each worker's slice
of the batch on its own, while an XLA SPMD run normalises over the whole global batch. This
module gives the cpu runtime the global statistics too: one autograd-aware all-reduce of the
per-channel sums per layer (``torch.distributed.nn.functional.all_reduce`` reduces the gradients
on the way back), so forward values, running statistics and gradients equal those of one
process holding the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce


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
