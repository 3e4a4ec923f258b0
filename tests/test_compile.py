"""The GPU path, tested on the CPU: the precision policy over GPU kinds, ``torch.compile`` in the
loop (same losses as eager, no recompile after warm-up, a shape change named, the compile time in
goodput), and weight decay kept off biases and normalisation weights as Transformers' Trainer does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytpu.config import load_config, with_values
from raytpu.config.plan import Facts, make_plan
from raytpu.hooks import Callback
from raytpu.records import goodput
from raytpu.records.goodput import Command
from raytpu.runtime import make_runtime
from raytpu.runtime.compiled import CompileWatch, compile_regions, compile_whole
from raytpu.runtime.placement import ClusterOffer, NodeType
from raytpu.storage.run_folder import RunFolder
from raytpu.worker.loop import Trainer
from raytpu.worker.optim import build_optimizer, decay_groups
from raytpu.worker.reporting import FolderReporter

TOY = ["job.name=tests.toy_job", "data.global_batch_size=8", "loop.log_every=1", "logging.progress_bar=false"]


def cuda_plan(*node_labels: str, precision: str = "auto"):
    cfg, _ = load_config(None, [*TOY, f"scaling.precision={precision}", "scaling.num_workers=1"])
    gpu = NodeType("gpu", {"CPU": 8.0, "GPU": 1.0, **dict.fromkeys(node_labels, 1.0)}, max_count=1)
    offer = ClusterOffer(nodes=({"CPU": 4.0},), available={"CPU": 4.0}, node_types=(gpu,), node_types_from="test")
    return make_plan(cfg, Facts(mode="train", offer=offer, where="here"))


def test_auto_precision_is_bf16_on_gpus_that_have_it_and_says_why():
    modern = cuda_plan("accelerator_type:H100")
    assert (modern.config.scaling.runtime, modern.config.scaling.precision) == ("cuda", "bf16")
    assert "scaling.precision auto -> bf16: bf16 autocast with fp32 weights" in " ".join(modern.notes)
    assert modern.config.loop.compile == "true"  # auto compiles on cuda
    unlabelled = cuda_plan()  # a worker whose GPU has no bf16 runs fp16 and records it (devices.json)
    assert unlabelled.config.scaling.precision == "bf16"
    old = cuda_plan("accelerator_type:T4")
    assert old.config.scaling.precision == "fp16" and "this GPU has no bf16" in " ".join(old.notes)
    assert cuda_plan("accelerator_type:T4", precision="fp32").config.scaling.precision == "fp32"


def test_a_gpu_has_bf16_by_its_compute_capability_not_by_emulation(monkeypatch):
    """V100 (7.0) and T4 (7.5) emulate bf16, and ``torch.cuda.is_bf16_supported()`` says yes there:
    a worker on them runs fp16 with a gradient scaler, which is their fast path."""
    from raytpu.runtime.base import has_bf16, local_gpu_has_bf16

    assert [has_bf16(c) for c in ((6, 0), (7, 0), (7, 5), (8, 0), (8, 9), (9, 0))] == [False] * 3 + [True] * 3
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert not local_gpu_has_bf16()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert local_gpu_has_bf16()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.linear(x))


class Blocks(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def compiled_graphs(model: nn.Module) -> int:
    """The graphs Dynamo compiles for one training step of ``model``, compiled regionally."""
    torch._dynamo.reset()
    assert compile_regions(model, "default")
    watch = CompileWatch()
    watch.begin_step()
    model(torch.ones(2, 4)).sum().backward()
    return watch.graphs() - watch._graphs_before


def test_repeated_blocks_compile_once_for_all_of_them_and_keep_their_names():
    """However deep the model, its blocks share one graph (the parts around them have their own:
    none on torch 2.9, whose in-place compile of a built-in module's forward compiles nothing)."""
    model = Blocks(depth=3)
    names = list(model.state_dict())
    assert compiled_graphs(model) == compiled_graphs(Blocks(depth=6)) <= 3
    assert list(model.state_dict()) == names  # checkpoints load into an uncompiled model
    assert not compile_regions(nn.Sequential(nn.Linear(4, 4)), "default")


def test_a_compile_after_warm_up_is_named_with_its_reason():
    torch._dynamo.reset()
    layer = compile_whole(nn.Linear(4, 2), "default")
    watch = CompileWatch()
    for step, rows in enumerate([3, 3, 3, 5], start=1):
        watch.begin_step()
        layer(torch.ones(rows, 4))
        message = watch.end_step(step, warm=step > 2)
    assert watch.recompiles == 1 and message is not None
    assert message.startswith("step 4 compiled 1 new torch.compile graph(s): ") and "size mismatch" in message
    assert watch.seconds() > 0


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, trainer, step: int, values: dict[str, float]) -> None:
        self.losses.append(values["loss"])


def train(run_dir, compile_mode: str) -> tuple[list[float], Trainer]:
    cfg, job = load_config(None, [*TOY, "loop.epochs=3", "optim.lr=0.05", "job.dropout=0"])
    runtime = make_runtime("cpu", "fp32", 1, 0, 0, compile_mode=compile_mode)
    losses, command = Losses(), Command()
    goodput.begin(RunFolder(str(run_dir)), command)
    trainer = Trainer(cfg, job, runtime, run_dir, run_dir, FolderReporter(run_dir), callbacks=[losses], command=command)
    trainer.fit()
    return losses.losses, trainer


def test_the_compiled_loop_learns_as_eager_without_recompiling_and_counts_its_compile(tmp_path):
    """The toy job, 3 epochs with an evaluation after each: the compiled losses equal eager's to
    float tolerance (inductor reorders sums), no graph compiles after the first steps of an epoch,
    and the compile time lands in goodput's compilation phase."""
    eager, _ = train(tmp_path / "eager", "")
    torch._dynamo.reset()
    compiled, trainer = train(tmp_path / "compiled", "default")
    assert len(compiled) == len(eager) == 24
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-5)
    assert trainer.runtime.compiled == "whole" and trainer.runtime.metrics()["compile/recompiles_after_warmup"] == 0
    categories = goodput.breakdown(goodput.read_record(RunFolder(str(tmp_path / "compiled"))))["categories"]
    assert 0 < categories["compilation"] <= trainer.runtime.compile_seconds(), categories


def test_weight_decay_leaves_what_transformers_trainer_leaves():
    """On a Llama model, the parameters that decay are the ones Transformers' Trainer decays
    (``get_decay_parameter_names``): no bias, no RMSNorm gain; the embeddings and projections do."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    expected = set(transformers.Trainer.get_decay_parameter_names(None, model))  # its rule uses no Trainer state
    names = {id(param): name for name, param in model.named_parameters()}
    decayed, undecayed = decay_groups(model, 0.1)
    assert {names[id(p)] for p in decayed["params"]} == expected
    assert undecayed["weight_decay"] == 0 and any("norm" in names[id(p)] for p in undecayed["params"])
    biased = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.LayerNorm(2))
    assert [len(group["params"]) for group in decay_groups(biased, 0.1)] == [1, 5]
    assert len(decay_groups(biased, 0.0)) == 1  # no decay: one group, the optimizer state's old layout


def test_fused_adam_only_where_asked():
    cfg, _ = load_config(None, [*TOY, "optim.name=adamw", "optim.weight_decay=0.01"])
    model = nn.Linear(2, 2)
    assert build_optimizer(cfg.optim, model).defaults["fused"] is None
    sgd = with_values(cfg, {"optim.name": "sgd"})
    assert isinstance(build_optimizer(sgd.optim, model, fused=True), torch.optim.SGD)


@pytest.mark.integration
def test_a_compiled_run_on_two_ray_workers_trains_and_evaluates_without_recompiling(ray_session, tmp_path, capfd):
    """``loop.compile=true`` through Ray Train: 2 CPU workers, DDP over gloo inside the compiled
    graph; 2 epochs with an evaluation after each; no graph compiled after warm-up on any log step,
    the compile time in the run's goodput."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from raytpu import cli

    config = tmp_path / "toy.yaml"
    config.write_text(f"job: {{name: tests.toy_job}}\ndata: {{path: {tmp_path}}}\n")
    where = [f"run.storage_path={tmp_path / 'results'}", "run.name=compiled"]
    extra = ["scaling.num_workers=2", "loop.epochs=2", "loop.log_every=4", "loop.compile=true"]
    assert cli.main(["train", str(config), *TOY, *extra, *where]) == 0
    assert "2 cpu worker(s), fp32, torch.compile (default)" in capfd.readouterr().out
    run = tmp_path / "results" / "compiled"
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    recompiles = [event.value for event in events.Scalars("compile/recompiles_after_warmup")]
    assert len(recompiles) == 4 and not any(recompiles), recompiles
    assert len(events.Scalars("valid/mse")) == 2
    categories = goodput.breakdown(goodput.read_record(RunFolder(str(run))))["categories"]
    assert categories["compilation"] > 0, categories
