"""loop.sync_batchnorm: the policy per runtime and layout, and the cpu runtime's global BatchNorm
(2 gloo processes, each with half the batch) against one process holding the whole batch."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from raytpu.runtime import batchnorm_scope
from raytpu.runtime.torch_ddp import GlobalBatchNorm, convert_to_global_batchnorm


@pytest.mark.parametrize(
    "runtime, requested, spmd, workers, scope",
    [
        ("cpu", "auto", False, 2, "local"),
        ("cpu", "false", False, 2, "local"),
        ("cpu", "true", False, 2, "global"),
        ("cuda", "auto", False, 2, "global"),
        ("cuda", "false", False, 2, "local"),
        ("xla", "auto", True, 1, "global"),
        ("xla", "false", True, 4, "global"),
        ("xla", "auto", False, 4, "local"),
        ("cpu", "false", False, 1, "global"),
    ],
)
def test_scope_per_runtime_and_layout(runtime, requested, spmd, workers, scope):
    assert batchnorm_scope(runtime, requested, spmd, workers) == scope


def test_per_chip_xla_cannot_sync():
    with pytest.raises(ValueError, match="needs xla.spmd=true"):
        batchnorm_scope("xla", "true", False, 4)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=0.3), nn.ReLU(), nn.Conv2d(4, 2, 1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 6, 6, generator=generator) * 3 + 1, torch.randn(8, 2, 4, 4, generator=generator)


def worker(rank: int, rendezvous: str, queue: mp.Queue) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2, timeout=timedelta(minutes=2))
    net = convert_to_global_batchnorm(model())
    x, target = batch()
    half = slice(rank * 4, rank * 4 + 4)
    x = x[half].requires_grad_(True)
    out = net(x)
    (out - target[half]).square().sum().backward()
    grads = {name: p.grad.numpy() for name, p in net.named_parameters()}
    stats = net[1].running_mean.numpy(), net[1].running_var.numpy()
    # numpy arrays travel by value; tensors would be shared through file descriptors that
    # vanish when this process exits before the test reads them
    queue.put((rank, out.detach().numpy(), x.grad.numpy(), grads, *stats))
    dist.barrier()
    dist.destroy_process_group()


def as_tensors(value):
    if isinstance(value, dict):
        return {key: torch.from_numpy(array) for key, array in value.items()}
    if isinstance(value, tuple):
        return tuple(as_tensors(item) for item in value)
    return torch.from_numpy(value)


def test_global_batchnorm_on_two_gloo_workers_equals_one_process_with_the_whole_batch(tmp_path):
    reference = model()
    x, target = batch()
    x.requires_grad_(True)
    out = reference(x)
    (out - target).square().sum().backward()

    context = mp.get_context("spawn")
    queue = context.Queue()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"  # a free port can be taken by another test's Ray node
    processes = [context.Process(target=worker, args=(rank, rendezvous, queue)) for rank in range(2)]
    for process in processes:
        process.start()
    results = {item[0]: as_tensors(item[1:]) for item in (queue.get(timeout=120) for _ in processes)}
    for process in processes:
        process.join(timeout=60)
    torch.testing.assert_close(torch.cat([results[0][0], results[1][0]]), out.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([results[0][1], results[1][1]]), x.grad, rtol=1e-5, atol=1e-5)
    for name, param in reference.named_parameters():  # what DDP sums (then averages) over the workers
        torch.testing.assert_close(results[0][2][name] + results[1][2][name], param.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results[0][3], reference[1].running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][4], reference[1].running_var, rtol=1e-5, atol=1e-6)


def test_conversion_keeps_the_state_dict_and_is_plain_batchnorm_alone():
    plain = model()
    converted = convert_to_global_batchnorm(model())
    assert isinstance(converted[1], GlobalBatchNorm)
    assert plain.state_dict().keys() == converted.state_dict().keys()
    x, _ = batch()
    torch.testing.assert_close(converted(x), plain(x))  # no process group: a plain BatchNorm
