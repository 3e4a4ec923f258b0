"""Transformers causal-LM architectures as users fine-tune them, each built tiny from its config:
tied and untied output layers, sliding-window attention, soft-capped logits, mixture-of-experts
layers. Each trains, checkpoints, resumes to the weights of an uninterrupted run and exports a
folder that Transformers loads with its tie in place and raytpu's evaluation logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raytpu.config import load_config
from raytpu.jobs.causal_lm import corpus
from raytpu.records import checkpoints as ckpt
from raytpu.runtime import make_runtime
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter
from tests.conftest import ROOT

SMALL = str(ROOT / "jobs" / "causal_lm" / "small.yaml")
LAYERS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "max_position_embeddings": 64}  # fmt: skip
#: name -> (model_type, model_config): a window of 8 tokens is shorter than the 32-token blocks
ARCHITECTURES = {
    # tied by default, with its dropout: a resumed run draws the masks of an uninterrupted one
    "gpt2": ("gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64}),
    "llama-tied": ("llama", {**LAYERS, "tie_word_embeddings": True}),  # Llama 3.2 1B / 3B
    "llama": ("llama", {**LAYERS, "tie_word_embeddings": False}),
    "qwen2": ("qwen2", {**LAYERS, "tie_word_embeddings": True}),  # Qwen2.5 0.5B - 3B
    "gemma2": ("gemma2", {**LAYERS, "head_dim": 16, "sliding_window": 8}),  # tied, soft-capped, sliding
    "mistral": ("mistral", {**LAYERS, "sliding_window": 8}),
    "phi3": ("phi3", LAYERS),
    "olmo2": ("olmo2", LAYERS),
    "qwen2_moe": (
        "qwen2_moe",
        {
            **LAYERS,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),  # fmt: skip
}
#: the architectures whose output layer is their input embedding
TIED = {"gpt2", "llama-tied", "qwen2", "gemma2"}
#: 32-token blocks, a global batch of 4, a checkpoint every 2 steps
TINY = ["job.vocab_size=512", "job.seq_len=32", "data.global_batch_size=4", "checkpoint.every_steps=2",
        "loop.eval_every_steps=2", "loop.log_every=1", "logging.progress_bar=false", "job.sample_tokens=4",
        "data.eval_batch_size=8", "data.max_eval_samples=8", "checkpoint.num_to_keep=5"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("architectures") / "data"
    corpus.synthesize(root, vocab_size=512)
    return root


def model_words(name: str) -> list[str]:
    """The architecture in place of the config's (its whole ``job.model_config``)."""
    model_type, fields = ARCHITECTURES[name]
    return [f"job.model_type={model_type}", f"job.model_config={json.dumps(fields)}"]


def fit(run_dir: Path, data: Path, name: str, *words: str) -> Trainer:
    cfg, job = load_config(SMALL, [f"data.path={data}", *TINY, *model_words(name), *words])
    trainer = Trainer(cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), run_dir, data, FolderReporter(run_dir))
    trainer.fit()
    return trainer


def eval_logits(name: str, data: Path, checkpoint: Path, ids: torch.Tensor) -> torch.Tensor:
    """The logits raytpu's evaluation computes with ``checkpoint``'s weights."""
    cfg, job = load_config(SMALL, [f"data.path={data}", *TINY, *model_words(name)])
    model = job.build_model(cfg)
    ckpt.load_into(model, ckpt.load_model_weights(checkpoint))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_trains_resumes_and_exports(name, data, tmp_path):
    from transformers import AutoModelForCausalLM

    from raytpu import api

    straight = fit(tmp_path / "straight", data, name, "loop.max_steps=4")
    fit(tmp_path / "stopped", data, name, "loop.max_steps=2")
    resumed = fit(tmp_path / "stopped", data, name, "loop.max_steps=4")
    assert resumed.progress.step == 4
    final = tmp_path / "straight" / "checkpoint_00000004"
    expected = ckpt.load_model_weights(final)
    again = ckpt.load_model_weights(tmp_path / "stopped" / "checkpoint_00000004")
    assert again.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(again[key], expected[key], rtol=0, atol=0)

    model = straight.runtime.unwrap(straight.model)
    tied = ckpt.tied_names(model)
    assert not tied.keys() & expected.keys()  # a tied tensor is written once
    out = tmp_path / "export"
    overrides = [f"data.path={data}", *TINY, *model_words(name)]
    api.export(SMALL, *overrides, out=out, checkpoint=str(final))
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert ckpt.tied_names(exported) == tied  # the tie in place
    ids = corpus.PackedBlocks(corpus.read_tokens(data, "valid"), 32)[0]["input_ids"][None]
    with torch.no_grad():
        theirs = exported(input_ids=ids).logits
    torch.testing.assert_close(theirs, eval_logits(name, data, final, ids), rtol=0, atol=1e-5)


def test_tied_models_are_the_ones_users_fine_tune():
    """The matrix holds tied models where their families tie (GPT-2, Llama 3.2, Qwen2.5, Gemma)."""
    from transformers import AutoConfig

    configs = {name: AutoConfig.for_model(kind, **fields) for name, (kind, fields) in ARCHITECTURES.items()}
    assert {name for name, config in configs.items() if config.tie_word_embeddings} == TIED


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_the_loss_the_sample_the_flops_and_the_estimate_are_the_architecture_s(name, data):
    """raytpu's model (its fused loss where the output layer is plain, its attention choice) against
    the architecture's own Transformers model with the same weights: the loss and every gradient,
    the greedy sample; the FLOPs of a mixture-of-experts model count the experts a token goes
    through; the memory estimate reads the architecture's widths."""
    from transformers import AutoModelForCausalLM

    from raytpu.jobs.causal_lm import architecture, generate
    from raytpu.worker.flops import matmul_parameters, transformer_flops_per_token

    cfg, job = load_config(SMALL, [f"data.path={data}", *TINY, *model_words(name)])
    torch.manual_seed(0)
    ours = job.build_model(cfg).eval()
    theirs = AutoModelForCausalLM.from_config(architecture(cfg.job)).eval()
    theirs.load_state_dict(ours.state_dict())
    ids = corpus.PackedBlocks(corpus.read_tokens(data, "train"), 32)[0]["input_ids"][None].repeat(2, 1)
    for model in (ours, theirs):
        model(input_ids=ids, labels=ids).loss.backward()
    torch.testing.assert_close(ours(input_ids=ids, labels=ids).loss, theirs(input_ids=ids, labels=ids).loss)
    for (key, mine), (_, reference) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-4, atol=1e-6, msg=key)

    tokenizer = corpus.load_tokenizer(data)
    prompt = tokenizer("def ", return_tensors="pt")["input_ids"]
    expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    assert generate(ours, tokenizer, "def ", 6) == tokenizer.decode(expected[0])

    config, experts = theirs.config, sum(p.numel() for n, m in theirs.named_modules() if n.endswith(".experts")
                                         for p in m.parameters())  # fmt: skip
    share = 2 / 4 if name == "qwen2_moe" else 1.0  # 2 of its 4 experts a token
    assert (experts > 0) == (name == "qwen2_moe")
    active = matmul_parameters(theirs) - experts * (1 - share)
    per_token = transformer_flops_per_token(round(active), config.num_hidden_layers, config.hidden_size, 32)
    assert job.flops_per_sample(cfg, ours) == per_token * 32
    assert job.activation_bytes(cfg, 4, 4, checkpointed=False) > 0


#: the matrix's runtimes and shardings: 2 gloo processes each for DDP and FSDP2, one on the XLA CPU device
LAYOUTS = {"ddp": ("cpu", 2, []), "fsdp2": ("cpu", 2, ["--fsdp", "full_shard"]), "xla": ("xla", 1, [])}


@pytest.fixture(scope="module")
def layouts(data, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """Every architecture trained, stopped and resumed on each layout (``tests/architecture_worker.py``),
    the layouts side by side."""
    from tests.conftest import finish, start_python

    started = {}
    for layout, (runtime, world, words) in LAYOUTS.items():
        out = tmp_path_factory.mktemp(layout)
        env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"} if runtime == "xla" else {}
        started[layout] = [
            start_python(
                ["-m", "tests.architecture_worker", str(out), str(data), runtime, *words],
                {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"},
            )
            for rank in range(world)
        ]
    reports = {}
    for layout, processes in started.items():
        done = [finish(process, timeout=1500) for process in processes]
        assert all(d.returncode == 0 for d in done), [d.stderr[-3000:] for d in done]
        lines = [json.loads(line) for line in done[0].stdout.splitlines() if line.startswith("{")]
        reports[layout] = {line["architecture"]: line for line in lines}
    return reports


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_architecture_resumes_exactly_on_ddp_fsdp2_and_xla(layouts, layout):
    found = layouts[layout]
    assert list(found) == list(ARCHITECTURES)
    for name, report in found.items():
        assert report["steps"] == 4 and report["same"], (name, report)
        assert report["sharded"] == (layout == "fsdp2"), (name, report)
        tied = {"lm_head.weight"} if name in TIED else set()
        assert set(report["tied"]) == tied, (name, report["tied"])  # the tie held on every runtime


@pytest.mark.parametrize("name", ["gpt2", "llama-tied", "qwen2_moe"])
def test_a_sharded_checkpoint_exports_with_the_tie_and_raytpu_s_logits(layouts, data, tmp_path, name):
    """An FSDP2 run's DCP shards, gathered by ``raytpu export`` into a folder Transformers loads."""
    from transformers import AutoModelForCausalLM

    from raytpu import api

    final = Path(layouts["fsdp2"][name]["checkpoint"])
    out = tmp_path / "export"
    api.export(SMALL, f"data.path={data}", *TINY, *model_words(name), out=out, checkpoint=str(final))
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert set(ckpt.tied_names(exported)) == ({"lm_head.weight"} if name in TIED else set())
    ids = corpus.PackedBlocks(corpus.read_tokens(data, "valid"), 32)[0]["input_ids"][None]
    with torch.no_grad():
        theirs = exported(input_ids=ids).logits
    torch.testing.assert_close(theirs, eval_logits(name, data, final, ids), rtol=0, atol=1e-5)


def test_pretrained_weights_under_fsdp2_are_read_shard_by_shard_as_from_pretrained_loads_them(tmp_path):
    """Every architecture of the matrix saved as a pretrained folder (a GPT-2 too whose file names
    lack ``transformer.``, as the Hub's gpt2 does), loaded by 2 FSDP2 processes: each reads its own
    rows of each weight from the files, where Transformers would load them unconverted, and the
    gathered model is ``from_pretrained``'s, tensor for tensor, its tie held; rank 0 loads the one
    whose experts Transformers fuses as it loads them (qwen2_moe), to the same model."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import finish, start_python

    folders = tmp_path / "pretrained"
    for name, (model_type, fields) in ARCHITECTURES.items():
        empty = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}  # none past 512
        config = AutoConfig.for_model(model_type, **fields, vocab_size=512, **empty)
        AutoModelForCausalLM.from_config(config).save_pretrained(folders / name)
    bare = folders / "gpt2-bare-names"
    AutoModelForCausalLM.from_pretrained(folders / "gpt2").save_pretrained(bare)
    weights = load_file(bare / "model.safetensors")
    save_file({key.removeprefix("transformer."): value for key, value in weights.items()}, bare / "model.safetensors")
    processes = [
        start_python(["-m", "tests.pretrained_worker", str(folders)], {"RANK": str(rank), "WORLD_SIZE": "2"})
        for rank in range(2)
    ]
    done = [finish(process, timeout=600) for process in processes]
    assert all(d.returncode == 0 for d in done), [d.stderr[-3000:] for d in done]
    lines = [json.loads(line) for line in done[0].stdout.splitlines() if line.startswith("{")]
    found = {line["folder"]: line for line in lines}
    assert sorted(found) == sorted([*ARCHITECTURES, "gpt2-bare-names"])
    for name, report in found.items():
        assert report["names"] and not report["differ"], (name, report)
        assert report["read_shards"] == (name != "qwen2_moe"), (name, report)
        tied = name.removesuffix("-bare-names") in TIED
        assert report["tied"] == (["lm_head.weight"] if tied else []), (name, report)
