"""One of 2 gloo processes that load pretrained folders under FSDP2 as a run does: ``python -m
tests.pretrained_worker FOLDERS`` with ``RANK`` and ``WORLD_SIZE`` set, each subfolder of FOLDERS a
``save_pretrained`` folder. For each, the causal LM job's model is built and sharded
(``Runtime.build``, ``prepare_model``, ``--fsdp full_shard``), then gathered whole; rank 0 prints one
JSON line per folder: how the ranks got their weights, and whether the gathered model equals
Transformers' ``from_pretrained`` tensor for tensor, its tie included. The ranks meet through a file."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from raytpu.config import load_config
from raytpu.config.plan import resolve_config
from raytpu.records import checkpoints as ckpt
from raytpu.runtime import make_runtime
from tests.test_architectures import SMALL


def load(folder: Path, rank: int, world: int) -> dict:
    from transformers import AutoModelForCausalLM

    words = [f"job.model_name_or_path={folder}", "--fsdp", "full_shard", f"scaling.num_workers={world}"]
    cfg, job = load_config(SMALL, [*words, "job.seq_len=32"])
    cfg = resolve_config(cfg, "cpu", "fp32")
    runtime = make_runtime("cpu", "fp32", world, rank, rank, sharding=cfg.sharding)
    model = runtime.prepare_model(runtime.build(lambda: job.build_model(cfg)))
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    buffers = {name: buffer.cpu() for name, buffer in model.named_buffers()}
    if rank:
        return {}
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = {**theirs.state_dict(), **dict(theirs.named_buffers())}
    found = {**gathered, **buffers}
    return {
        "folder": folder.name,
        "read_shards": runtime.weights is not None,
        "names": sorted(found) == sorted(expected),
        "differ": sorted(name for name, tensor in expected.items() if not same(tensor, found.get(name))),
        "tied": sorted(ckpt.tied_names(model)),
    }


def same(expected: torch.Tensor, found: torch.Tensor | None) -> bool:
    return found is not None and torch.equal(expected, found)


def main(folders: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rendezvous = f"file://{folders / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=timedelta(minutes=5))
    for folder in sorted(path for path in folders.iterdir() if path.is_dir()):
        found = load(folder, rank, world)
        if found:
            print(json.dumps(found), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
