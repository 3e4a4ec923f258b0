"""``torch.compile`` of a model on cpu and cuda, and the watch on what it compiles after warm-up.

A model with repeated blocks (a Transformers model's decoder layers, DiT's blocks: a
``ModuleList`` of one class) is compiled region by region with Accelerate's
``compile_regions_fsdp2``: each block in place (``module.compile()``), so that one compiled graph
serves every block and the compile takes seconds instead of minutes, parameter names stay plain
(checkpoints load into an uncompiled model) and hooks added later (DDP's, FSDP2's) still run.
Any other model is compiled whole, around its DDP wrapper (``torch.compile(DDP(model))``, so that
Dynamo splits the graph at DDP's buckets); ``Runtime.unwrap`` takes the wrapper off again.

Dynamo keeps, per compiled function, the reason each cached graph stopped matching
(``torch._dynamo.utils.guard_failures``): a compile after warm-up is named with that reason
(``tensor 'input_ids' size mismatch at index 1. expected 128, actual 96``), as the XLA runtime
names its recompiles.
"""

from __future__ import annotations

import torch
from torch import nn


def options(mode: str) -> dict[str, str]:
    return {} if mode == "default" else {"mode": mode}


def compile_regions(model: nn.Module, mode: str) -> bool:
    """Compile ``model``'s repeated blocks in place (and the parts around them); False when it has none."""
    from accelerate.utils.other import compile_regions_fsdp2, has_repeated_blocks

    if not has_repeated_blocks(model):
        return False
    compile_regions_fsdp2(model, **options(mode))
    return True


def compile_whole(model: nn.Module, mode: str) -> nn.Module:
    """``torch.compile(model)``: a wrapper whose ``_orig_mod`` is ``model``."""
    return torch.compile(model, **options(mode))


class CompileWatch:
    """Counts the graphs Dynamo compiles, step by step, and says why one compiled after warm-up."""

    def __init__(self) -> None:
        self.recompiles = 0
        self._graphs_before = self._reasons_before = 0

    @staticmethod
    def graphs() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    @staticmethod
    def reasons() -> list[str]:
        from torch._dynamo.utils import guard_failures

        return [reason for failures in guard_failures.values() for reason in failures]

    def begin_step(self) -> None:
        self._graphs_before, self._reasons_before = self.graphs(), len(self.reasons())

    def end_step(self, step: int, warm: bool) -> str | None:
        """A warning text when the step compiled a graph although it is ``warm`` (past the steps
        that may compile), else ``None``."""
        compiled = self.graphs() - self._graphs_before
        if compiled <= 0 or not warm:
            return None
        self.recompiles += compiled
        new = [" ".join(str(reason).split()) for reason in self.reasons()[self._reasons_before :]]
        why = f": {new[-1]}" if new else " (a new code path: a Python branch or a graph break)"
        return f"step {step} compiled {compiled} new torch.compile graph(s){why}"

    @staticmethod
    def seconds() -> float:
        """Seconds Dynamo and its backend spent compiling in this process (forward and backward)."""
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
