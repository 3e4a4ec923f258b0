"""The mesh's three axes (data, fsdp, tensor): their arithmetic and names, tensor parallelism from
the model's own plan, the refusals in one line, the memory estimate's tensor axis, the multislice
environment and hybrid mesh (the device order of two v5e-16 slices computed by torch_xla's own
HybridMesh), and the causal LM on 4 gloo processes: a (2 fsdp x 2 tensor) mesh against (4 fsdp),
loss for loss, and a checkpoint of one layout resumed in the other."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from raytpu import cli
from raytpu.config import load_config, with_values
from raytpu.config.batching import BatchPlan
from raytpu.config.memory import estimate_run
from raytpu.config.plan import resolve_config
from raytpu.errors import ConfigError
from raytpu.jobs.causal_lm import corpus
from raytpu.parallel.mesh import resolve_mesh
from raytpu.parallel.slices import multislice_env, slice_mesh
from raytpu.parallel.tensor import check_tensor_parallel, tensor_plan, xla_partition_specs
from raytpu.records import checkpoints as ckpt
from tests.conftest import ROOT, run_python
from tests.test_bad_input import assert_one_error_line

SMALL = str(ROOT / "jobs" / "causal_lm" / "small.yaml")


# ------------------------------------------------------------------ the axes
def test_the_axes_multiply_to_the_devices_and_minus_one_takes_the_rest():
    assert resolve_mesh(8, -1, -1, 1, "").shape == (1, 8, 1)  # --fsdp full_shard: every device on fsdp
    assert resolve_mesh(8, -1, 1, 1, "").shape == (8, 1, 1)  # data-parallel
    assert resolve_mesh(8, -1, -1, 2, "").shape == (1, 4, 2)
    assert resolve_mesh(8, 2, -1, 2, "").shape == (2, 2, 2)
    assert resolve_mesh(8, 1, 2, -1, "").shape == (1, 2, 4)
    shape = resolve_mesh(8, 2, 2, 2, "")
    assert (shape.devices, shape.replicas, shape.describe()) == (8, 4, "data 2 x fsdp 2 x tensor 2")
    with pytest.raises(ConfigError, match="makes 6 devices, not the 4 workers"):
        resolve_mesh(4, 1, 2, 3, "workers")
    with pytest.raises(ConfigError, match="sharding.mesh.tensor=0: each mesh axis is at least 1"):
        resolve_mesh(4, -1, 1, 0, "")
    with pytest.raises(ConfigError, match="both -1"):
        resolve_mesh(4, 1, -1, -1, "")


def test_the_mesh_is_named_as_torchprime_accelerate_and_the_earlier_xla_keys_name_it(tmp_path):
    for words in (
        ["sharding.mesh.tensor=2", "sharding.mesh.fsdp=2"],
        ["ici_mesh.tensor=2", "ici_mesh.fsdp=2"],
        ["--parallelism_config_tp_size", "2", "--parallelism_config_dp_shard_size", "2"],
    ):
        cfg, _ = load_config(SMALL, words)
        assert (cfg.sharding.mesh.fsdp, cfg.sharding.mesh.tensor) == (2, 2), words
    earlier = tmp_path / "earlier.yaml"
    earlier.write_text("job: {name: causal_lm}\nxla: {spmd: true, mesh: {data: 1, fsdp: 4}}\n")
    cfg, _ = load_config(earlier)
    assert (cfg.sharding.mesh.data, cfg.sharding.mesh.fsdp, cfg.xla.spmd) == (1, 4, True)


def test_a_tensor_axis_over_cpu_workers_shards_and_its_groups_share_their_samples():
    cfg, job = load_config(SMALL, ["scaling.num_workers=4", "sharding.mesh.tensor=2", "data.global_batch_size=8"])
    cfg = resolve_config(cfg, "cpu", "fp32")
    assert cfg.sharding.strategy == "full_shard" and cfg.sharding.mesh.fsdp == -1
    plan = BatchPlan.of(cfg)
    assert (plan.workers, plan.per_worker) == (2, 4)  # 2 tensor groups of 2 workers, 4 samples each
    on_xla = resolve_config(load_config(SMALL, ["sharding.mesh.tensor=2"])[0], "xla", "bf16")
    assert on_xla.xla.spmd and on_xla.sharding.strategy == "full_shard"
    assert BatchPlan.of(on_xla).workers == on_xla.scaling.num_workers  # the mesh is within a worker's devices


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (["sharding.mesh.tensor=3"], "makes 3 devices, not the 4 workers"),
        (["sharding.mesh.tensor=2", "sharding.mesh.data=2"], "set sharding.mesh.data=1"),
        (
            ["sharding.mesh.tensor=2", "scaling.num_workers=2:4", "data.global_batch_size=24"],
            "with an elastic range of workers is not offered",
        ),
    ],
    ids=["axes that do not divide", "replicas of a sharded model", "elastic"],
)
def test_a_mesh_the_workers_cannot_form_is_refused_in_one_line(words, expected):
    cfg, _ = load_config(SMALL, ["scaling.num_workers=4", "data.global_batch_size=8", *words])
    with pytest.raises(ConfigError, match=expected):
        resolve_config(cfg, "cpu", "fp32")


# ------------------------------------------------------------------ the model's plan
def tiny_llama(heads: int = 4, kv_heads: int = 2, hidden: int = 64) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads)  # fmt: skip
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def test_the_plan_is_transformers_own_and_splits_attention_and_mlp_megatron_style():
    plan = tensor_plan(tiny_llama())
    assert len(plan) == 2 * 7
    assert plan["model.layers.1.self_attn.q_proj"] == "colwise" and plan["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.0.mlp.up_proj"] == "colwise" and plan["model.layers.0.mlp.down_proj"] == "rowwise"
    specs = xla_partition_specs(tiny_llama(), "fsdp", "tensor")
    assert specs["model.layers.0.self_attn.q_proj.weight"] == ("tensor", "fsdp")  # outputs split: whole heads
    assert specs["model.layers.0.mlp.down_proj.weight"] == ("fsdp", "tensor")  # inputs split
    assert specs["model.embed_tokens.weight"] == ("tensor", "fsdp") == specs["lm_head.weight"]  # the vocabulary
    assert specs["model.layers.0.input_layernorm.weight"] == ("fsdp",)


def test_a_model_the_tensor_axis_cannot_split_is_refused_naming_why():
    with pytest.raises(ConfigError, match="does not divide the model's 6 attention heads"):
        check_tensor_parallel(tiny_llama(heads=6, kv_heads=6, hidden=96), 4)
    with pytest.raises(ConfigError, match="does not divide the 96 outputs of model.layers.0.mlp.gate_proj"):
        check_tensor_parallel(tiny_llama(heads=1, kv_heads=1), 64)
    from raytpu.jobs.mshnet.model import MSHNet

    with pytest.raises(ConfigError, match="MSHNet declares no tensor-parallel plan"):
        check_tensor_parallel(MSHNet(), 2)


def test_the_estimate_holds_a_split_layer_once_per_tensor_group():
    cfg, job = load_config(SMALL, ["scaling.num_workers=4", "data.global_batch_size=8", "scaling.runtime=cpu"])
    fsdp4 = estimate_run(resolve_config(with_values(cfg, {"sharding.strategy": "full_shard"}), "cpu", "fp32"), job)
    tp = estimate_run(resolve_config(with_values(cfg, {"sharding.mesh.tensor": 2}), "cpu", "fp32"), job)
    layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384  # q, o; k, v (2 of 4 heads); gate, up, down
    total = 2 * 4096 * 128 + 4 * (layer + 2 * 128) + 128
    assert fsdp4.weights == pytest.approx(4 * total / 4)
    assert tp.weights == pytest.approx(4 * ((total - 4 * layer) + 4 * layer / 2) / 2)  # the rest over 2 fsdp shards
    fsdp4_at_4 = estimate_run(
        resolve_config(
            with_values(cfg, {"sharding.strategy": "full_shard", "data.global_batch_size": 16}), "cpu", "fp32"
        ),
        job,
    )
    assert tp.activations == fsdp4_at_4.activations > fsdp4.activations  # a tensor group's 4 samples, not 2


# ------------------------------------------------------------------ refusals, from the command line
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mesh-lm") / "data"
    corpus.synthesize(root, vocab_size=4096)
    return root


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (["sharding.mesh.tensor=4", "job.model_config.num_attention_heads=2", "job.model_config.num_key_value_heads=2"],
         "does not divide the model's 2 attention heads"),
        (["xla.scan_layers=true"], "xla.scan_layers runs on the xla runtime"),
        (["scaling.tpu.slices=2"], "slices are TPU slices, and this run is on the cpu runtime"),
        (["job.model_type=qwen2", "job.model_config={}", "runtime=xla", "xla.scan_layers=true",
          "job.model_config.use_sliding_window=true", "job.model_config.max_window_layers=1",
          "job.model_config.num_hidden_layers=2", "scaling.num_workers=1"],
         "Qwen2ForCausalLM's blocks are not alike (its layers mix"),
    ],
    ids=["heads", "scan on cpu", "slices on cpu", "scan of unlike blocks"],
)  # fmt: skip
def test_what_cannot_split_the_model_is_one_line_before_any_worker(
    data, tmp_path, monkeypatch, capsys, words, expected
):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # xla on this machine's CPU
    local = ["--local", f"data.path={data}", f"run.storage_path={tmp_path}", "scaling.num_workers=4"]
    code = cli.main(["train", SMALL, *local, "data.global_batch_size=8", "scaling.runtime=cpu", *words])
    captured = capsys.readouterr()
    assert_one_error_line(code, captured.out, captured.err, expected)
    assert not (tmp_path / "causal_lm-small").exists()


# ------------------------------------------------------------------ several slices
def test_the_first_slice_of_rank_0_coordinates_and_each_slice_has_its_id():
    hosts = [
        ("slice-b", 1, "10.0.0.4"),
        ("slice-a", 0, "10.0.0.1"),
        ("slice-b", 0, "10.0.0.3"),
        ("slice-a", 1, "10.0.0.2"),
    ]
    envs = multislice_env(hosts)
    assert [env["MEGASCALE_SLICE_ID"] for env in envs] == ["0", "1", "0", "1"]
    assert {env["MEGASCALE_COORDINATOR_ADDRESS"] for env in envs} == {"10.0.0.3"}  # slice-b's worker 0
    assert {(env["MEGASCALE_NUM_SLICES"], env["MEGASCALE_PORT"]) for env in envs} == {("2", "8081")}  # Ray's port
    assert multislice_env([("slice-a", 0, "10.0.0.1"), ("slice-a", 1, "10.0.0.2")]) == [{}, {}]


def test_the_data_axis_spans_the_slices_and_the_rest_is_within_each():
    whole, ici, dcn = slice_mesh(32, 2, -1, -1, 1)  # --fsdp full_shard over two v5e-16 slices
    assert (whole.shape, ici, dcn) == ((2, 16, 1), (1, 16, 1), (2, 1, 1))
    assert slice_mesh(32, 2, 4, -1, 2)[1:] == ((2, 4, 2), (2, 1, 1))
    with pytest.raises(ConfigError, match="give it a multiple of 2"):
        slice_mesh(32, 2, 3, -1, 1)


HYBRID_ORDER = textwrap.dedent(
    """
    import json
    import numpy as np
    from torch_xla.distributed.spmd import HybridMesh

    class TwoV5e16Slices(HybridMesh):
        '''torch_xla's HybridMesh over the devices two v5e-16 slices report (4 hosts of 2x2 chips
        each, a chip a device): their ordinals, coords and slice_index; only the TPU query of the
        physical mesh is answered from those coords.'''

        def __init__(self, ici, dcn):
            self.device_attributes = []
            for ordinal in range(32):
                host, local = divmod(ordinal % 16, 4)
                x, y = 2 * (host % 2) + local % 2, 2 * (host // 2) + local // 2
                attributes = {"name": f"TPU:{ordinal}", "coords": [x, y, 0], "slice_index": ordinal // 16}
                self.device_attributes.append(attributes)
            self.order = self._create_hybrid_device_mesh(ici, dcn)

        def _get_physical_tpu_mesh(self, devices):
            out = np.empty((4, 4, 1), dtype=int)
            for d in devices:
                x, y, z = self.device_attributes[d]["coords"]
                out[x, y, z] = d
            return out

    print(json.dumps(TwoV5e16Slices((1, 16, 1), (2, 1, 1)).order.tolist()))
    """
)


def test_the_hybrid_mesh_puts_each_slice_s_devices_on_its_own_data_row():
    done = run_python(["-c", HYBRID_ORDER], env={"PJRT_DEVICE": "CPU"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    order = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(order) == 2 and all(len(row) == 16 for row in order)  # (data 2, fsdp 16, tensor 1)
    assert sorted(device for (device,) in order[0]) == list(range(16))  # slice 0's chips
    assert sorted(device for (device,) in order[1]) == list(range(16, 32))  # slice 1's


# ------------------------------------------------------------------ 4 gloo processes
TINY = ["job.model_config.hidden_size=64", "job.model_config.intermediate_size=128",
        "job.model_config.num_hidden_layers=2", "job.seq_len=64", "job.sample_tokens=0", "data.global_batch_size=8",
        "data.eval_batch_size=64", "data.max_eval_samples=64", "loop.clip_grad_norm=0.5", "loop.max_steps=20",
        "loop.log_every=1", "--eval_steps", "5", "--save_steps", "10", "--warmup_steps", "2",
        "checkpoint.num_to_keep=4", "logging.progress_bar=false", "scaling.num_workers=4", "--local"]  # fmt: skip


def scalars(run_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return [event.value for event in EventAccumulator(str(run_dir / "tensorboard")).Reload().Scalars(tag)]


@pytest.fixture(scope="module")
def layouts(data, tmp_path_factory):
    """The tiny LM for 20 steps on 4 local processes as (2 fsdp x 2 tensor) and as (4 fsdp); the
    first's step-10 checkpoint resumed as (4 fsdp)."""
    out = tmp_path_factory.mktemp("mesh")
    common = [*TINY, f"data.path={data}", f"run.storage_path={out}"]
    assert cli.main(["train", SMALL, *common, "run.name=tensor", "sharding.mesh.tensor=2"]) == 0
    assert cli.main(["train", SMALL, *common, "run.name=fsdp", "--fsdp", "full_shard"]) == 0
    shutil.copytree(out / "tensor", out / "across")
    for later in ("checkpoint_00000020", "tensorboard"):
        shutil.rmtree(out / "across" / later)
    assert cli.main(["train", SMALL, *common, "run.name=across", "--fsdp", "full_shard"]) == 0
    return out


@pytest.mark.integration
def test_a_tensor_parallel_mesh_follows_the_fsdp_one_loss_for_loss(layouts):
    """Every step's gradient norm (over all the gradients) and the validation loss every 5 steps
    within 1e-4 (TensorBoard's per-step train/loss is rank 0's own samples, which the layouts
    split differently)."""
    for tag in ("train/grad_norm", "valid/loss"):
        tensor, fsdp = scalars(layouts / "tensor", tag), scalars(layouts / "fsdp", tag)
        assert len(tensor) == len(fsdp) >= 4 and tensor == pytest.approx(fsdp, rel=1e-4), (tag, tensor, fsdp)
    losses = scalars(layouts / "fsdp", "valid/loss")
    assert len(losses) == 4 and losses[0] - losses[-1] > 0.3  # it learns far more than the tolerance
    final = layouts / "tensor" / "checkpoint_00000020"
    assert sorted(path.name for path in (final / ckpt.SHARDED).iterdir())[:2] == [".metadata", "__0_0.distcp"]
    assert json.loads((final / ckpt.META).read_text())["sharded"] is True
    whole = ckpt.load_model_weights(final)  # as raytpu test and raytpu export read it: the whole model
    expected = ckpt.load_model_weights(layouts / "fsdp" / "checkpoint_00000020")
    assert whole.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(whole[key], expected[key], rtol=1e-3, atol=1e-4)


@pytest.mark.integration
def test_a_tensor_parallel_checkpoint_resumes_in_the_fsdp_layout(layouts):
    for tag, resumed_at in (("train/grad_norm", 10), ("valid/loss", 2)):
        resumed, straight = scalars(layouts / "across", tag), scalars(layouts / "fsdp", tag)
        assert resumed == pytest.approx(straight[resumed_at:], rel=1e-4), (tag, resumed, straight)
    weights = ckpt.load_model_weights(layouts / "across" / "checkpoint_00000020")
    expected = ckpt.load_model_weights(layouts / "fsdp" / "checkpoint_00000020")
    assert weights.keys() == expected.keys() and len(weights) == 2 * 9 + 3  # the plain model's names
    for key in expected:
        torch.testing.assert_close(weights[key], expected[key], rtol=1e-3, atol=1e-4)  # Adam magnifies rounding


def test_doctor_says_what_a_run_over_two_slices_needs_and_how_its_mesh_spans_them():
    from raytpu.driver.doctor import multislice_lines

    words = ["runtime=xla", "scaling.tpu.accelerator_type=TPU-V5LITEPOD", "scaling.tpu.topology=4x4"]
    cfg, _ = load_config(SMALL, [*words, "scaling.tpu.slices=2", "--fsdp", "full_shard", "scaling.num_workers=8"])
    lines = multislice_lines(cfg)
    assert lines[0].startswith("slices     2 x v5litepod-16 (4 host(s) x 4 chips each)"), lines
    assert "mesh data 2 x fsdp 16 x tensor 1: HybridMesh ici (1, 16, 1), dcn (2, 1, 1)" in lines[0]
    assert "MEGASCALE_COORDINATOR_ADDRESS" in lines[1] and "scaling.tpu.layout=spmd" in lines[2]
    assert multislice_lines(load_config(SMALL, words)[0]) == []  # one slice: nothing to say


def test_a_mesh_the_slices_chips_cannot_form_is_refused_before_the_run():
    from raytpu.runtime.kinds import kind_of
    from raytpu.runtime.placement import ClusterOffer

    slice_words = ["runtime=xla", "xla.spmd=true", "scaling.tpu.accelerator_type=TPU-V5LITEPOD"]
    slice_words.append("scaling.tpu.topology=4x4")
    node = {"CPU": 8.0, "TPU": 4.0}
    offer = ClusterOffer(nodes=(node,), available=node)
    cfg, _ = load_config(SMALL, [*slice_words, "scaling.num_workers=4", "sharding.mesh.tensor=3"])
    with pytest.raises(ConfigError, match="not the 16 chips of the TPU-V5LITEPOD slice"):
        kind_of("xla").check_workers(cfg, offer)
    two = load_config(SMALL, [*slice_words, "scaling.num_workers=8", "scaling.tpu.slices=2", "sharding.mesh.data=3"])[0]
    with pytest.raises(ConfigError, match="give it a multiple of 2"):
        kind_of("xla").check_workers(two, offer)
    fits = load_config(SMALL, [*slice_words, "scaling.num_workers=4", "sharding.mesh.tensor=4"])[0]
    kind_of("xla").check_workers(fits, offer)
