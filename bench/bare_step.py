"""One DDP training step of MSHNet small, by hand: the baseline of ``bench/startup.py``.

Run under ``torchrun --nproc_per_node 2 bench/bare_step.py DATA_DIR``. It imports only torch
and the job's own model, data and loss files (loaded by path, so not even the job package's
``__init__`` with its metrics and raytpu imports), and trains one step over gloo.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

JOB = Path(__file__).resolve().parents[1] / "jobs" / "mshnet"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bare_{name}", JOB / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(data_dir: str) -> None:
    model_file, data_file, loss_file = load("model"), load("data"), load("loss")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dataset = data_file.IRSTDDataset(Path(data_dir), "train", 64, 64, seed=0)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, drop_last=True)
    model = DistributedDataParallel(model_file.MSHNet(3, [16, 32, 64, 128, 256]), find_unused_parameters=True)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    batch = next(iter(loader))
    side, logits = model(batch["image"], False)
    loss = loss_file.mshnet_loss(side, logits, batch["mask"], False)
    loss.backward()
    optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
