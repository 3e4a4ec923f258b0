"""A pretrained model's weights read shard by shard under FSDP2, each worker its own rows, as
torchtitan loads a Hugging Face checkpoint: no worker ever holds the whole model.

Every worker builds the architecture with its parameters on the meta device (its buffers as built:
rotary frequencies are in no checkpoint), FSDP2 shards it there, then each worker makes its own
shards on its device and fills them with the rows they hold, read from the safetensors files
(``safe_open(...).get_slice``): a worker holds its shard and the file pages it read. Where this
cannot be taken, rank 0 loads the whole model and sends each unit as it is sharded (Accelerate's
``cpu_ram_efficient_loading``): :meth:`raytpu.runtime.torch_fsdp.FSDPRuntime.build`.

It is taken when every parameter is in the files under one of its names (with or without the base
model's prefix, as ``from_pretrained`` takes either) and in its shape, and Transformers would convert
none of the checkpoint's weights as it loads them (its ``conversion_mapping``: the experts that
mixture-of-experts models fuse, for one): then the files hold exactly what ``from_pretrained`` would
put in the model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard


@dataclass(frozen=True)
class ShardedWeights:
    """Where each of a model's tensors is read: its name (every name of a tied one) -> the file key."""

    keys: dict[str, str]
    files: dict[str, Path]  # file key -> its file

    @classmethod
    def of(cls, model: nn.Module, files: list[Path]) -> ShardedWeights | None:
        """The reading of ``model``'s weights from ``files``, or None where it cannot be taken."""
        if not files or converted(model):
            return None
        from safetensors import safe_open

        shapes: dict[str, tuple[int, ...]] = {}
        located: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (a safetensors handle is no mapping)
                    shapes[key], located[key] = tuple(handle.get_slice(key).get_shape()), Path(file)
        prefix = getattr(model, "base_model_prefix", "")
        keys: dict[str, str] = {}
        for names, tensor in aliased(model.named_parameters(remove_duplicate=False)):
            key = found(names, tuple(tensor.shape), shapes, prefix)
            if key is None:
                return None
            keys.update(dict.fromkeys(names, key))
        for names, tensor in aliased(model.named_buffers(remove_duplicate=False)):
            key = found(names, tuple(tensor.shape), shapes, prefix)  # a persistent buffer a checkpoint holds
            if key is not None:
                keys.update(dict.fromkeys(names, key))
        return cls(keys, located)

    @torch.no_grad()
    def fill(self, model: nn.Module, device: torch.device) -> None:
        """Make ``model``'s (sharded) parameters on ``device`` and fill each with its rows."""
        from safetensors import safe_open

        built = dict(model.named_buffers())
        model.to_empty(device=device)
        with contextlib.ExitStack() as stack:
            handles = {
                file: stack.enter_context(safe_open(str(file), framework="pt")) for file in set(self.files.values())
            }
            for name, buffer in model.named_buffers():
                key = self.keys.get(name)
                buffer.copy_(handles[self.files[key]].get_tensor(key) if key else built[name])
            for name, param in model.named_parameters():
                key = self.keys[name]
                local, (start, stop) = own_rows(param)
                if local.numel():
                    source = handles[self.files[key]].get_slice(key)
                    local.copy_(source[start:stop] if param.dim() else source[:])


def converted(model: nn.Module) -> bool:
    """Whether Transformers would change the checkpoint's weights as it loads them into ``model``."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return bool(get_model_conversion_mapping(model, add_legacy=False))


def aliased(named: object) -> list[tuple[list[str], torch.Tensor]]:
    """Each tensor once, with every name it has (a tied embedding has two)."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in named:  # type: ignore[attr-defined]
        names.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    return [(names[key], tensors[key]) for key in names]


def found(names: list[str], shape: tuple[int, ...], shapes: dict[str, tuple[int, ...]], prefix: str) -> str | None:
    """The file key of a tensor called ``names``, of ``shape``: a name as it is, without the base
    model's prefix (GPT-2's ``h.0...`` for ``transformer.h.0...``) or with it."""
    for name in names:
        bare = name.removeprefix(f"{prefix}.") if prefix else name
        for key in (name, bare, f"{prefix}.{name}" if prefix else name):
            if shapes.get(key) == shape:
                return key
    return None


def own_rows(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """This worker's part of ``param`` and the rows of the whole it holds: FSDP2 shards dim 0 in
    ``torch.chunk``'s pieces, the last workers' empty where the rows run out."""
    if not isinstance(param, DTensor):
        return param, (0, param.shape[0] if param.dim() else 0)
    local = param.to_local()
    if tuple(param.placements) != (Shard(0),):
        raise RuntimeError(f"a parameter sharded as {param.placements}, where FSDP2 shards its rows (Shard(0))")
    rows, workers = param.shape[0], param.device_mesh.size()
    piece = -(-rows // workers)
    start = min(param.device_mesh.get_local_rank() * piece, rows)
    stop = min(start + piece, rows)
    if local.shape[0] != stop - start:
        raise RuntimeError(f"a shard of {local.shape[0]} rows where rows {start}:{stop} of {rows} were expected")
    return local, (start, stop)
