"""fp8 (``scaling.precision: fp8``), tested on the CPU: the layers it converts, the plan's refusals
by device, the flags, and an fp8 run's checkpoint tested and resumed in other precisions. torchao's
tensorwise float8 matmul runs on CPUs too (``torch._scaled_mm``), so the runtime trains in float8
here, though the plan offers fp8 only on GPUs that have float8 tensor cores."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytpu.config import load_config, with_values
from raytpu.config.plan import Facts, make_plan
from raytpu.errors import ConfigError
from raytpu.jobs.causal_lm import corpus
from raytpu.records import checkpoints as ckpt
from raytpu.runtime import make_runtime
from raytpu.runtime.base import has_float8
from raytpu.runtime.kinds import kind_of
from raytpu.runtime.placement import ClusterOffer, NodeType
from raytpu.runtime.torch_ddp import float8_layers
from raytpu.runtime.torch_fsdp import native_runtime
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter
from tests.conftest import ROOT

pytest.importorskip("torchao")

SMALL = str(ROOT / "jobs" / "causal_lm" / "small.yaml")
TINY = ["job.model_config.num_hidden_layers=2", "job.sample_tokens=0", "scaling.num_workers=1", "job.vocab_size=512"]
RUN = [
    "data.global_batch_size=4",
    "loop.max_steps=2",
    "loop.epochs=1",
    "loop.log_every=1",
    "logging.progress_bar=false",
]
RUN += ["checkpoint.every_steps=2", "loop.eval_every_steps=2", "data.eval_batch_size=8", "optim.warmup_steps=0"]
#: float8 matrix products on a CPU without native float8 kernels run at a few MFLOP/s (two small
#: linear layers over 8,192 tokens: 48 s on one 2-core machine): short blocks, one eval batch
RUN += ["job.seq_len=32", "data.max_eval_samples=8"]


def test_every_linear_layer_but_the_head_and_odd_shapes_becomes_float8():
    cfg, job = load_config(SMALL, [*TINY, "job.model_config.intermediate_size=200"])  # 200: no multiple of 16
    model = job.build_model(cfg)
    chosen = float8_layers(model)
    assert chosen and "lm_head" not in chosen
    assert all(name.split(".")[-1] in {"q_proj", "k_proj", "v_proj", "o_proj"} for name in chosen)
    assert len(chosen) == 4 * 2  # the attention's four projections in each of the 2 layers; the MLP's are 200 wide
    plain = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.Linear(48, 16))
    assert float8_layers(plain) == ["0", "2"]  # the last linear layer is the head


def gpu_plan(*labels: str):
    cfg, _ = load_config(None, ["job.name=tests.toy_job", "scaling.precision=fp8", "scaling.num_workers=1"])
    gpu = NodeType("gpu", {"CPU": 8.0, "GPU": 1.0, **dict.fromkeys(labels, 1.0)}, max_count=1)
    offer = ClusterOffer(nodes=({"CPU": 4.0},), available={"CPU": 4.0}, node_types=(gpu,), node_types_from="test")
    return make_plan(cfg, Facts(mode="train", offer=offer, where="here"))


def test_fp8_is_planned_on_gpus_with_float8_and_refused_elsewhere_in_one_line():
    assert gpu_plan("accelerator_type:H100").config.scaling.precision == "fp8"
    assert gpu_plan().config.scaling.precision == "fp8"  # unknown kind: the worker's GPU decides
    with pytest.raises(ConfigError, match="compute capability 8.9.*the cluster's GPUs are A100"):
        gpu_plan("accelerator_type:A100")
    for runtime in ("cpu", "xla", "torch_tpu"):
        with pytest.raises(ConfigError, match=f"on the {runtime} runtime: use scaling.precision=bf16"):
            kind_of(runtime).precision("fp8")
    with pytest.raises(ConfigError, match="this GPU has no bf16 either"):
        kind_of("cuda").precision("fp8", bf16_supported=False)
    assert has_float8((8, 9)) and has_float8((9, 0)) and not has_float8((8, 0))


def test_a_launched_script_s_accelerate_gets_fp8_with_torchao():
    from raytpu.config.plan import ScriptPlan
    from raytpu.worker.script import process_environment

    env = process_environment(ScriptPlan(path="train.py", mixed_precision="fp8"), kind_of("cuda"))
    assert (env["ACCELERATE_MIXED_PRECISION"], env["ACCELERATE_FP8_BACKEND"]) == ("fp8", "AO")
    assert "ACCELERATE_FP8_BACKEND" not in process_environment(
        ScriptPlan(path="t.py", mixed_precision="bf16"), kind_of("cuda")
    )


def test_accelerate_s_mixed_precision_flag_and_the_recipe():
    cfg, _ = load_config(SMALL, ["--mixed_precision", "fp8", "scaling.fp8_recipe=rowwise"])
    assert (cfg.scaling.precision, cfg.scaling.fp8_recipe) == ("fp8", "rowwise")
    assert load_config(SMALL, ["--mixed_precision", "no"])[0].scaling.precision == "fp32"
    with pytest.raises(ConfigError, match="scaling.fp8_recipe='blockwise' is not one of tensorwise, rowwise"):
        load_config(SMALL, ["scaling.fp8_recipe=blockwise"])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8") / "data"
    corpus.synthesize(root, vocab_size=512)
    return root


def test_an_fp8_checkpoint_is_plain_weights_that_test_and_resume_in_other_precisions(data, tmp_path):
    """fp8 trains (in float8 on the CPU), its checkpoint holds the plain model's names in fp32, a
    fp32 test loads it strictly, and a bf16 run resumes from it and goes on from its step."""
    cfg, job = load_config(SMALL, [*TINY, *RUN, f"data.path={data}"])
    fp8 = native_runtime("cpu", "cpu", "fp8", 1, 0, 0, {"fp8_recipe": "tensorwise"})
    trained = tmp_path / "fp8"
    reporter = FolderReporter(trained)
    trainer = Trainer(cfg, job, fp8, trained, data, reporter)
    trainer.fit()
    assert fp8.float8_layers and "lm_head" not in fp8.float8_layers
    assert sum(type(module).__name__ == "Float8Linear" for module in trainer.model.modules()) == 2 * 7
    latest = reporter.latest_checkpoint()
    weights = ckpt.load_model_weights(str(latest))
    assert set(weights) == set(job.build_model(cfg).state_dict())
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}
    tested = with_values(cfg, {"checkpoint.weights": str(latest)})
    fp32 = make_runtime("cpu", "fp32", 1, 0, 0)
    metrics = Trainer(tested, job, fp32, tmp_path / "test", data, FolderReporter(tmp_path / "test")).test()
    assert metrics["test/perplexity"] > 1
    resumed_cfg = with_values(cfg, {"checkpoint.resume_from": str(latest), "loop.max_steps": 3})
    resumed = tmp_path / "bf16"
    bf16 = native_runtime("cpu", "cpu", "bf16", 1, 0, 0, {})
    trainer = Trainer(resumed_cfg, job, bf16, resumed, data, FolderReporter(resumed))
    trainer.fit()
    assert trainer.progress.step == 3


def test_fp8_under_fsdp2_shards_the_float8_layers_and_keeps_plain_names():
    cfg, job = load_config(SMALL, [*TINY, "sharding.strategy=full_shard"])
    runtime = native_runtime("cpu", "cpu", "fp8", 1, 0, 0, {"sharding": cfg.sharding})
    torch.manual_seed(0)
    model = runtime.prepare_model(job.build_model(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 512, (4, 32))
    losses = []
    for _ in range(3):
        with runtime.autocast():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        runtime.backward(loss)
        runtime.optimizer_step(optimizer, list(model.parameters()), 1.0)
        optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0] and runtime.sharded and runtime.float8_layers
    assert set(model.state_dict()) == set(job.build_model(cfg).state_dict())


def test_a_tied_model_trains_in_fp8_under_fsdp2_checkpoints_and_resumes_with_its_tie(data, tmp_path):
    """Tied embeddings (GPT-2's, Llama 3.2's): the output head, its input embedding, stays out of
    float8, the tie holds through FSDP2's sharding and into the checkpoint (where the tie once
    crashed the first save), and a resume goes on with the tie in place."""
    tied = [*TINY, *RUN, f"data.path={data}", "job.model_config.tie_word_embeddings=true", "--fsdp", "full_shard"]
    cfg, job = load_config(SMALL, tied)
    fp8 = native_runtime("cpu", "cpu", "fp8", 1, 0, 0, {"fp8_recipe": "tensorwise", "sharding": cfg.sharding})
    trainer = Trainer(cfg, job, fp8, tmp_path / "fp8", data, FolderReporter(tmp_path / "fp8"))
    trainer.fit()
    model = fp8.unwrap(trainer.model)
    assert fp8.sharded and fp8.float8_layers and "lm_head" not in fp8.float8_layers
    assert model.lm_head.weight is model.model.embed_tokens.weight
    latest = FolderReporter(tmp_path / "fp8").latest_checkpoint()
    weights = ckpt.load_model_weights(str(latest))
    assert torch.equal(weights.get("lm_head.weight", weights["model.embed_tokens.weight"]),
                       weights["model.embed_tokens.weight"])  # fmt: skip
    resumed_cfg = with_values(cfg, {"checkpoint.resume_from": str(latest), "loop.max_steps": 3})
    again = native_runtime("cpu", "cpu", "fp8", 1, 0, 0, {"fp8_recipe": "tensorwise", "sharding": cfg.sharding})
    resumed = Trainer(resumed_cfg, job, again, tmp_path / "resumed", data, FolderReporter(tmp_path / "resumed"))
    resumed.fit()
    model = again.unwrap(resumed.model)
    assert resumed.progress.step == 3 and model.lm_head.weight is model.model.embed_tokens.weight
