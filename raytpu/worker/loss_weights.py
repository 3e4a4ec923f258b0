"""The weight of each micro-batch's loss in a step whose loss averages over items that vary in
number (:class:`raytpu.job.AveragesOverItems`: a fine-tuning batch's trained tokens).

Each worker's loss is the mean over its batch's items, and the data-parallel wrappers average the
gradients over the workers; a step of ``accum`` micro-batches averaged those means again. A step's
loss is then the mean of means, which counts an item of a short batch more than one of a long
batch. Weighting micro-batch ``i`` of a worker by ``n_i x workers / N`` (``n_i`` its items, ``N``
the items of the whole step on every worker) makes the step's gradient that of the mean over all
``N`` items, as Transformers' Trainer computes it (``num_items_in_batch``, summed over devices).

The count ``N`` is one small all-reduce per step. A static-graph runtime (XLA) with several workers
keeps the mean of means: the count would be a second graph or a read back each step.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from raytpu.job import AveragesOverItems, Batch, Job
from raytpu.runtime import Runtime


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
