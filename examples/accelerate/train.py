"""A small training script written the way Accelerate users write theirs (CDEIT's ``main.py`` style):
``Accelerator``, ``prepare``, ``backward``, ``clip_grad_norm_``, ``gather`` for metrics,
``save_state`` every ``--ckpt-every`` steps, the seed flags. It makes its own data (a noisy linear
regression) and runs unchanged under ``python``, ``accelerate launch`` and ``raytpu launch``:

    python examples/accelerate/train.py --epochs 2
    accelerate launch --num_processes 2 --cpu examples/accelerate/train.py --epochs 2
    raytpu launch --num_processes 2 examples/accelerate/train.py --epochs 2

Under ``raytpu launch`` a restarted run resumes from the last saved state: the one line that
reads ``RAYTPU_RESUME_FROM`` below is all a script needs for that.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Progress:
    """Where training is, saved with the state so that a resumed run continues from it."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def make_data(samples: int, features: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator)
    weight = torch.linspace(-1, 1, features)
    y = x @ weight + 0.1 * torch.randn(samples, generator=generator)
    return TensorDataset(x, y[:, None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=8)
    parser.add_argument("--ckpt-every", type=int, default=16)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--global-seed", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (to test restarts)")
    parser.add_argument("--results-dir", default="results/accelerate-example")
    args = parser.parse_args()

    # a seeded sampler: the same sample order whatever the number of processes
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(args.global_seed)
    per_process = args.global_batch_size // accelerator.num_processes
    loader = DataLoader(make_data(args.samples, 16, args.global_seed), batch_size=per_process, shuffle=True)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    computed_in: list[torch.dtype] = []  # what the first layer computes in (prepare() returns fp32 outputs)
    first_layer = accelerator.unwrap_model(model)[0]
    first_layer.register_forward_hook(lambda module, inputs, out: computed_in.append(out.dtype) or None)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if os.environ.get("RAYTPU_RESUME_FROM"):  # the one line for restarts under raytpu launch
        accelerator.load_state()
        accelerator.print(f"resumed at step {progress.step}")
    accelerator.print(f"{accelerator.distributed_type}, {accelerator.num_processes} process(es)")
    print(f"process {accelerator.process_index} of {accelerator.num_processes} (pid {os.getpid()})", flush=True)

    steps_per_epoch = len(loader)
    results = Path(args.results_dir)
    loss = torch.zeros(())
    timed_from, started = progress.step + args.log_every, time.perf_counter()
    while progress.step < args.epochs * steps_per_epoch:
        epoch, done = divmod(progress.step, steps_per_epoch)
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done) if done else loader
        for x, y in batches:
            with accelerator.autocast():
                prediction = model(x)
                loss = nn.functional.mse_loss(prediction.float(), y)
            if progress.step == 0:
                accelerator.print(f"forward dtype {computed_in[0]}")
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            if progress.step % args.log_every == 0:
                mean = accelerator.gather(loss.detach()[None]).mean().item()
                accelerator.print(f"epoch {epoch} step {progress.step} loss {mean:.5f}")
                accelerator.log({"train/loss": mean}, step=progress.step)
            if progress.step % args.ckpt_every == 0:
                accelerator.save_state(str(results / f"state_{progress.step:06d}"))
            if progress.step == timed_from:
                started = time.perf_counter()
            time.sleep(args.step_sleep)
    elapsed = time.perf_counter() - started
    timed = (progress.step - timed_from) * args.global_batch_size
    accelerator.wait_for_everyone()
    weights = {k: v.detach().cpu() for k, v in accelerator.get_state_dict(model).items()}  # off the device first
    if accelerator.is_main_process:
        results.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(results / "final.safetensors"))
    final = accelerator.gather(loss.detach()[None]).mean().item()
    summary = {"steps": progress.step, "final_loss": final, "processes": accelerator.num_processes}
    accelerator.print(json.dumps({**summary, "samples_per_s": timed / elapsed if timed > 0 else None}))


if __name__ == "__main__":
    main()
