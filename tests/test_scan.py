"""Scanned decoder layers (``xla.scan_layers``) and the 2-D mesh on XLA SPMD: the stacked weights
under their unrolled names, the optimizer's groups kept; on 4 XLA CPU devices (one probe process),
a (2 fsdp x 2 tensor) mesh against (4 fsdp) loss for loss over 20 steps, its weights split as the
plan says, a checkpoint of one layout resumed in the other, and the scanned model (FSDPv2 and
gradient checkpointing) against the unrolled one; the model's output layer tied to its embeddings,
as most fine-tuned models have it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from raytpu.jobs.causal_lm import corpus
from raytpu.parallel.scan import STACKED, ScannedLayers, layer_stack, scan_in_place
from raytpu.worker.optim import decay_groups
from tests.conftest import XlaProbe, run_python


def tiny_llama(layers: int = 3) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(config)


def test_the_stacked_layers_keep_the_unrolled_names_in_and_out_of_a_state_dict():
    plain = tiny_llama()
    scanned = tiny_llama()
    stack = layer_stack(scanned, list(scanned.model.layers))
    names = scan_in_place(stack, recompute=False)
    assert isinstance(stack, ScannedLayers) and len(stack) == 3
    assert names[STACKED + "self_attn__q_proj__weight"] == "0.self_attn.q_proj.weight"
    assert len(list(scanned.parameters())) == 9 + 3  # a stacked tensor for each weight of a layer, and the rest
    assert stack.stacked()["mlp.up_proj.weight"].shape == (3, 64, 32)
    state, expected = scanned.state_dict(), plain.state_dict()
    assert state.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(state[key], expected[key], rtol=0, atol=0)
    moved = {key: value + 1 for key, value in expected.items()}
    scanned.load_state_dict(moved)  # the unrolled names, stacked as they load
    torch.testing.assert_close(
        stack.stacked()["input_layernorm.weight"][2], moved["model.layers.2.input_layernorm.weight"]
    )
    with pytest.raises(ValueError, match="slice it whole"):
        stack[:2]


def test_a_model_that_calls_its_layers_one_by_one_is_refused_in_one_line():
    """GPT-2 loops ``for block in self.h``: the emptied layers say so instead of failing on a missing weight."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from raytpu.errors import ConfigError

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16))
    scan_in_place(layer_stack(model, list(model.transformer.h)), recompute=False)
    with pytest.raises(ConfigError, match="calls its GPT2Block layers one by one.*set xla.scan_layers=false"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_a_stacked_norm_keeps_out_of_weight_decay_as_the_unrolled_ones():
    scanned = tiny_llama()
    scan_in_place(layer_stack(scanned, list(scanned.model.layers)), recompute=False)
    decayed, exempt = decay_groups(scanned, 0.1)
    stacked = scanned.model.layers.stacked()
    assert any(p is stacked["input_layernorm.weight"] for p in exempt["params"])
    assert any(p is stacked["self_attn.q_proj.weight"] for p in decayed["params"])
    plain_exempt = decay_groups(tiny_llama(), 0.1)[1]["params"]
    assert sum(p.numel() for p in exempt["params"]) == sum(p.numel() for p in plain_exempt)


def lm(data: Path, *words: str) -> list[str]:
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True}  # fmt: skip
    return ["job.name=causal_lm", f"data.path={data}", f"job.model_config={json.dumps(shape)}", "job.seq_len=64",
            "job.sample_tokens=0", "data.global_batch_size=8", "data.max_eval_samples=16", "scaling.num_workers=1",
            "loop.max_steps=20", "loop.log_every=1", "optim.lr=0.01", "optim.weight_decay=0.1",
            "scaling.precision=fp32", *words]  # fmt: skip


@pytest.fixture(scope="module")
def meshes(tmp_path_factory) -> dict[str, dict]:
    """On 4 XLA CPU devices in one process: (4 fsdp); (2 fsdp x 2 tensor); that mesh for 10 steps,
    then (4 fsdp) on to 20 from its checkpoint. Side by side, in processes of their own: scanned
    layers under FSDPv2 with gradient checkpointing (run again, alone, where torch_xla crashed the
    process); on one XLA device, unrolled and scanned layers with gradient checkpointing. fp32: the
    layouts add the same products in other orders."""
    root = tmp_path_factory.mktemp("scan")
    data = root / "data"
    corpus.synthesize(data, vocab_size=4096)
    fsdp = ["xla.spmd=true", "--fsdp", "full_shard"]
    tensor = ["sharding.mesh.tensor=2", "sharding.mesh.fsdp=2"]
    across = [f"run.storage_path={root}", "run.name=across", "checkpoint.every_steps=10"]
    runs = [lm(data, *fsdp), lm(data, *tensor), lm(data, *tensor, *across, "loop.max_steps=10")]
    meshes = XlaProbe(4, *runs, lm(data, *fsdp, *across), env={"TF_CPP_MIN_LOG_LEVEL": "1"})  # XLA's warnings asked for
    scanned_run = lm(data, *fsdp, "xla.scan_layers=true", "--gradient_checkpointing")
    scanned = XlaProbe(4, scanned_run)
    checkpointed = lm(data, "--gradient_checkpointing")
    one_device = XlaProbe(1, checkpointed, [*checkpointed, "xla.scan_layers=true"])
    reports = dict(zip(("fsdp", "tensor", "first", "resumed"), meshes.reports(), strict=True))
    reports["unrolled_one"], reports["scanned_one"] = one_device.reports()
    if scanned.crash():  # once more, alone (a crash of torch_xla, not raytpu: it must not fail on a busy machine)
        scanned = XlaProbe(4, scanned_run)
    crash = scanned.crash()
    reports["scanned"] = {"crash": crash} if crash else scanned.reports()[0]
    reports["scanned_prepared"] = scanned.prepared()  # printed before its first step: there even after a crash
    reports["consoles"] = {"meshes": meshes.done().stderr, "scanned": scanned.done().stderr}
    return reports


@pytest.mark.xla
def test_a_2x2_mesh_follows_the_fsdp_mesh_loss_for_loss_and_compiles_once(meshes):
    fsdp, tensor = meshes["fsdp"]["losses"], meshes["tensor"]["losses"]
    assert len(fsdp) == len(tensor) == 20 and tensor == pytest.approx(fsdp, rel=1e-4), (fsdp, tensor)
    assert fsdp[0] - fsdp[-1] > 0.5  # far more than the tolerance
    for run in ("fsdp", "tensor"):
        assert meshes[run]["compiles_after_warmup"] == 0 and meshes[run]["fallbacks_after_warmup"] == [], run


@pytest.mark.xla
def test_the_tensor_axis_splits_whole_heads_the_mlp_and_the_vocabulary(meshes):
    shardings = meshes["tensor"]["shardings"]
    # the (data 1, fsdp 2, tensor 2) mesh over devices 0..3: the second dimension's split is the tensor axis
    assert shardings["model.layers.0.self_attn.q_proj.weight"].startswith("{devices=[2,2]0,2,1,3"), shardings
    assert shardings["model.layers.0.mlp.down_proj.weight"].startswith("{devices=[2,2]0,1,2,3"), shardings
    assert shardings["model.embed_tokens.weight"].startswith("{devices=[2,2]0,2,1,3"), shardings
    assert meshes["tensor"]["input_sharding"].startswith("{devices=[2,1,2]"), meshes["tensor"]  # batch over fsdp


@pytest.mark.xla
def test_a_checkpoint_of_the_2x2_mesh_resumes_on_the_fsdp_mesh(meshes):
    first, resumed, fsdp = meshes["first"]["losses"], meshes["resumed"]["losses"], meshes["fsdp"]["losses"]
    assert len(first) == 10 and len(resumed) == 10, (first, resumed)
    assert resumed == pytest.approx(fsdp[10:], rel=1e-4), (resumed, fsdp)


@pytest.mark.xla
def test_scanned_layers_train_as_the_unrolled_ones_with_checkpointing(meshes):
    scanned, unrolled = meshes["scanned_one"], meshes["unrolled_one"]
    assert scanned["losses"] == pytest.approx(unrolled["losses"], rel=1e-4), (scanned["losses"], unrolled["losses"])
    # the stack, once per weight; beside it the embeddings (the output layer's weight too: tied) and the norm
    assert scanned["parameters"] == 9 + 2 and unrolled["parameters"] == 2 * 9 + 2
    assert scanned["compiles_after_warmup"] == 0 and scanned["fallbacks_after_warmup"] == [], scanned


@pytest.mark.xla
def test_scanned_layers_under_fsdpv2_are_wrapped_and_sharded_as_planned(meshes):
    """raytpu's part, read before the first step: where torch_xla kills the process in a step, this
    still runs."""
    (prepared,) = meshes["scanned_prepared"]
    assert prepared["fsdp_wrappers"] == 1  # the root: the layers' weights are the stack's
    stacked = prepared["shardings"]["model.layers.stacked__mlp__down_proj__weight"]  # (2 layers, 64, 128)
    assert stacked.startswith("{devices=[1,4,1]"), prepared["shardings"]  # each layer's weight over fsdp


@pytest.mark.xla
def test_scanned_layers_under_fsdpv2_train_as_the_unrolled_ones(meshes):
    scanned, fsdp = meshes["scanned"], meshes["fsdp"]
    if "crash" in scanned:  # torch_xla's scan under SPMD calls JAX (shard_alike) in its backward
        warnings.warn(f"torch_xla CRASHED running its scan under SPMD: {scanned['crash'][:300]}", stacklevel=1)
        pytest.skip(
            "TORCH_XLA CRASHED (twice, the second time alone) running its scan under SPMD on this machine's CPU "
            f"PJRT device; raytpu's wrapping and shardings were checked before the step: {scanned['crash']}"
        )
    assert scanned["losses"] == pytest.approx(fsdp["losses"], rel=1e-4), (scanned["losses"], fsdp["losses"])
    assert scanned["compiles_after_warmup"] == 0 and scanned["fallbacks_after_warmup"] == [], scanned


#: what the libraries under a sharded XLA run say at its start or at every compile or forward
NOTICES = (
    "GSPMD sharding propagation is going to be deprecated",  # XLA's C++ warning, at each compiled graph
    "Tensorflow library not found",  # flax's, imported through torchax at the first sharding
    "Unable to initialize backend 'tpu'",  # JAX's look for a TPU, in the scan's backward
    "For backward hooks to be called",  # torch's, at every forward of FSDPv2's root wrapper
)


@pytest.mark.xla
def test_a_sharded_run_s_console_holds_none_of_its_libraries_notices_unless_xla_s_are_asked_for(meshes):
    """raytpu.runtime.xla.quiet_xla_logs: the scanned FSDPv2 run says none of them; the mesh runs,
    whose environment sets TF_CPP_MIN_LOG_LEVEL=1 (the user's level wins), show XLA's warnings."""
    consoles = meshes["consoles"]
    said = [notice for notice in NOTICES if notice in consoles["scanned"]]
    assert said == [], consoles["scanned"][-3000:]
    assert NOTICES[0] in consoles["meshes"], consoles["meshes"][-3000:]


#: require_jax_bridge in a process of its own (torch_xla imported), flax importable or not
BRIDGE = """import sys
if sys.argv[1] == "without-flax":
    sys.modules["flax"] = None  # an environment without flax: importing it fails
from raytpu.errors import ConfigError
from raytpu.parallel.scan import require_jax_bridge
try:
    require_jax_bridge()
    print("bridge: ok")
except ConfigError as exc:
    print(f"refused: {exc}")
"""


@pytest.mark.xla
def test_scanned_layers_under_spmd_are_refused_in_one_line_where_torchax_cannot_be_imported():
    """torch_xla's scan under SPMD calls JAX through torchax in its backward, and torchax imports
    flax: without it the process died of a segmentation fault in its first step."""
    env = {"PJRT_DEVICE": "CPU"}
    found = {case: run_python(["-c", BRIDGE, case], env) for case in ("with-flax", "without-flax")}
    assert found["with-flax"].stdout.strip() == "bridge: ok", found["with-flax"].stderr[-2000:]
    refused = found["without-flax"].stdout.strip()
    assert refused.startswith("refused: xla.scan_layers under SPMD: torch_xla's scan calls JAX through"), refused
    assert "install raytpu's xla (or tpu) extra, or set xla.scan_layers=false" in refused and "\n" not in refused


def test_a_run_resumed_with_the_other_xla_scan_layers_is_one_line(tmp_path, capsys):
    """The optimizer state of a scanned run is the stack's: resuming it unrolled (or the other way)
    is refused before anything starts, naming the checkpoint to start a new run from."""
    from raytpu import cli
    from tests.test_bad_input import assert_one_error_line

    data = tmp_path / "data"
    corpus.synthesize(data, vocab_size=4096)
    written = tmp_path / "runs" / "scanned" / "checkpoint_00000002"
    written.mkdir(parents=True)
    (written / "meta.json").write_text(json.dumps({"step": 2, "config": {"xla": {"scan_layers": True}}}))
    words = ["--local", f"data.path={data}", f"run.storage_path={tmp_path / 'runs'}", "run.name=scanned"]
    code = cli.main(["train", str(Path(__file__).parents[1] / "jobs" / "causal_lm" / "small.yaml"), *words])
    captured = capsys.readouterr()
    assert_one_error_line(code, captured.out, captured.err, "checkpoint_00000002 was written with xla.scan_layers=true")
