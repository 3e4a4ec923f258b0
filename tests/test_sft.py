"""Instruction and chat fine-tuning: conversations through the model's chat template, the loss on
what the assistant says, packing that keeps documents apart, LoRA adapters exported for PEFT. TRL's
``SFTTrainer`` is the reference: the same tiny model, rows and masks give the same first-step loss,
padded and packed; PEFT loads raytpu's adapters and gives raytpu's logits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from raytpu import cli
from raytpu.config import load_config
from raytpu.corpus.prepare import prepare_text
from raytpu.hooks import Callback
from raytpu.jobs.causal_lm import corpus, sft
from raytpu.records import checkpoints as ckpt
from raytpu.runtime import make_runtime
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter
from tests.conftest import ROOT, run_python

FINETUNE = str(ROOT / "jobs" / "causal_lm" / "finetune.yaml")
#: ChatML, with the assistant's turns between generation marks (what assistant_only_loss reads)
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LENGTH = 128


def conversation(i: int) -> dict:
    turns = [{"role": "user", "content": f"what is {i} times {i + 1}?"},
             {"role": "assistant", "content": f"{i * (i + 1)}, as {i} x {i + 1}."}]  # fmt: skip
    return {"messages": ([{"role": "system", "content": "be brief"}] if i % 2 else []) + turns}


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 (tied embeddings, as Qwen2.5's small models) saved with a tokenizer and its chat template."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    root = tmp_path_factory.mktemp("sft")
    corpus.synthesize(root / "tokenizer-data", vocab_size=512)
    tokenizer = corpus.load_tokenizer(root / "tokenizer-data")
    tokenizer.chat_template = TEMPLATE
    config = Qwen2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    folder = root / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def words(model_dir: Path, train: Path, *more: str) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--train_file", str(train), "--validation_file", str(train),
            "--max_length", str(LENGTH), "scaling.runtime=cpu", "scaling.num_workers=1", "scaling.precision=fp32",
            "job.sample_tokens=0", "--logging_steps", "1", "logging.progress_bar=false", *more]  # fmt: skip


class FirstLoss(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, trainer, step: int, values: dict[str, float]) -> None:
        self.losses.append(values["loss"])


def first_step(model_dir: Path, train: Path, tmp: Path, *more: str) -> tuple[float, int]:
    """raytpu's first logged loss on all the rows in one batch (the batch: every prepared row)."""
    probe, job = load_config(FINETUNE, words(model_dir, train, *more, f"data.path={tmp / 'prepared'}"))
    root = prepare_text(probe, job)
    rows = len(sft.Rows(root / "sft-train", LENGTH, 0))
    cfg, job = load_config(FINETUNE, words(model_dir, train, *more, f"data.path={root}",
                                           f"data.global_batch_size={rows}", "loop.max_steps=1"))  # fmt: skip
    log = FirstLoss()
    Trainer(cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), tmp / "run", root, FolderReporter(tmp / "run"),
            callbacks=[log]).fit()  # fmt: skip
    return log.losses[0], rows


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_first_step_loss_is_trl_s_on_the_same_rows(model_dir, tmp_path, layout):
    """Eight conversations with assistant-only loss, one batch: raytpu's loss equals the loss TRL's
    SFTTrainer computes on its first batch (its padding, or its packing without padding)."""
    train = write_rows(tmp_path / "conversations.jsonl", [conversation(i) for i in range(8)])
    packing = ["--packing"] if layout == "packed" else []
    ours, rows = first_step(model_dir, train, tmp_path, "--assistant_only_loss", *packing)
    args = ["-m", "tests.trl_reference", str(model_dir), str(train), str(tmp_path / "trl"), str(rows), str(LENGTH)]
    done = run_python([*args, layout], env={"USE_TORCH_XLA": "0", "PJRT_DEVICE": ""}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert theirs["rows"] == rows  # the same rows: 8 padded, or as many packed
    assert ours == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6)


def test_masks_labels_positions_and_segments_of_the_prepared_rows(model_dir, tmp_path):
    """The assistant's tokens alone are labels; packed rows restart positions at each document and
    never attend across them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    how = sft.Tokenizing(assistant_only_loss=True, chat_template=TEMPLATE)
    ids, labels = sft.tokenized(conversation(3), tokenizer, how, "row 1")
    kept = tokenizer.decode([token for token, label in zip(ids, labels) if label != -100])
    assert kept == "12, as 3 x 4.<|im_end|>"
    prompt = {"prompt": "2 + 2 =", "completion": " 4"}
    ids, labels = sft.tokenized(prompt, tokenizer, sft.Tokenizing(), "row 1")
    assert tokenizer.decode([t for t, label in zip(ids, labels) if label != -100]) == " 4" + tokenizer.eos_token
    train = write_rows(tmp_path / "c.jsonl", [conversation(i) for i in range(8)])
    cfg, job = load_config(FINETUNE, [*words(model_dir, train, "--packing", f"data.path={tmp_path / 'p'}"),
                                      "--max_length", "256"])  # fmt: skip
    rows = sft.Rows(prepare_text(cfg, job) / "sft-train", 256, 0)
    row = max((rows[i] for i in range(len(rows))), key=lambda row: int(row["segments"].max()))
    starts = (row["position_ids"] == 0) & (row["segments"] >= 0)
    assert int(starts.sum()) == int(row["segments"].max()) + 1 >= 2  # several documents, each from position 0
    mask = sft.document_mask(row["segments"][None])[0, 0]
    first, second = (row["segments"] == 0).nonzero()[-1], (row["segments"] == 1).nonzero()[0]
    assert not mask[second, first] and mask[first, first]


def test_lora_trains_what_it_adds_checkpoints_it_alone_and_exports_for_peft(model_dir, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raytpu import api

    train = write_rows(tmp_path / "c.jsonl", [conversation(i) for i in range(16)])
    lora = ["--use_peft", "--lora_r", "4", "--lora_target_modules", "all-linear", "--learning_rate", "1e-2"]
    lora += ["--lr_scheduler_type", "constant"]  # the same lr whatever the run's length: a stopped run resumes to it
    common = [*words(model_dir, train, *lora), f"data.path={tmp_path / 'p'}", "--output_dir", str(tmp_path / "runs"),
              "data.global_batch_size=4", "checkpoint.every_steps=2"]  # fmt: skip
    assert cli.main(["train", FINETUNE, "--local", *common, "loop.max_steps=4", "run.name=straight"]) == 0
    assert cli.main(["train", FINETUNE, "--local", *common, "loop.max_steps=2", "run.name=resumed"]) == 0
    assert cli.main(["train", FINETUNE, "--local", *common, "loop.max_steps=4", "run.name=resumed"]) == 0
    final = tmp_path / "runs" / "straight" / "checkpoint_00000004"
    weights = ckpt.load_model_weights(final)
    assert weights and all("lora_" in key for key in weights), sorted(weights)[:5]  # the adapters alone
    again = ckpt.load_model_weights(tmp_path / "runs" / "resumed" / "checkpoint_00000004")
    assert all(torch.equal(again[key], weights[key]) for key in weights)  # resumed exactly

    cfg, job = load_config(FINETUNE, common)
    ours = job.build_model(cfg)
    ckpt.load_into(ours, weights)
    ids = torch.tensor([[5, 17, 42, 99, 3, 8]])
    with torch.no_grad():
        expected = ours.eval()(input_ids=ids).logits
    adapter = tmp_path / "adapter"
    api.export(FINETUNE, *common, out=adapter, checkpoint=str(final))
    assert (adapter / "adapter_config.json").is_file()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    merged = tmp_path / "merged"
    api.export(FINETUNE, *common, "--merged", out=merged, checkpoint=str(final))
    capsys.readouterr()
    plain = [*words(model_dir, train), f"data.path={tmp_path / 'p'}", "--checkpoint", str(final), "--out", str(merged)]
    assert cli.main(["export", FINETUNE, *plain]) == 2  # without the run's LoRA settings: its config is named
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("raytpu: error:")]
    assert f"export with the config its run trained with: raytpu export {final.parent / 'config.yaml'}" in error
    alone = AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        torch.testing.assert_close(alone(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_lora_under_fsdp2_keeps_a_bf16_base_and_fp32_adapters(model_dir, tmp_path):
    """Two local processes, the base loaded in bf16 (--dtype bfloat16), the adapters in fp32: each
    its own FSDP2 group, the same losses as the data-parallel run; the checkpoint's shards hold
    the adapters alone."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = write_rows(tmp_path / "c.jsonl", [conversation(i) for i in range(16)])
    common = [*words(model_dir, train, "--use_peft", "--dtype", "bfloat16"), "scaling.num_workers=2", "--local",
              f"data.path={tmp_path / 'p'}", "--output_dir", str(tmp_path / "runs"), "data.global_batch_size=4",
              "loop.max_steps=3"]  # fmt: skip
    assert cli.main(["train", FINETUNE, *common, "run.name=fsdp", "--fsdp", "full_shard"]) == 0
    assert cli.main(["train", FINETUNE, *common, "run.name=ddp"]) == 0
    losses = {}
    for name in ("fsdp", "ddp"):
        events = EventAccumulator(str(tmp_path / "runs" / name / "tensorboard")).Reload()
        losses[name] = [event.value for event in events.Scalars("train/loss")]
    assert losses["fsdp"] == pytest.approx(losses["ddp"], rel=1e-3), losses
    sharded = ckpt.load_model_weights(tmp_path / "runs" / "fsdp" / "checkpoint_00000003")
    assert sharded and all("lora_" in key for key in sharded)


def test_a_step_s_loss_is_the_mean_over_all_its_trained_tokens_however_the_batch_is_split(model_dir, tmp_path):
    """Conversations of uneven lengths (so batches train on uneven numbers of tokens): one worker
    with the whole batch, two workers with half each, and one worker in two micro-batches take the
    same steps, as Transformers' Trainer does (average_tokens_across_devices), not a mean of means."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [conversation(i * 7) if i % 3 else {"messages": [*conversation(i)["messages"]] * 3} for i in range(16)]
    train = write_rows(tmp_path / "c.jsonl", rows)
    common = [*words(model_dir, train, "--learning_rate", "1e-3", "--assistant_only_loss"), "--local",
              f"data.path={tmp_path / 'p'}", "--output_dir", str(tmp_path / "runs"), "data.global_batch_size=4",
              "loop.max_steps=3"]  # fmt: skip
    runs = {"whole": [], "workers": ["scaling.num_workers=2"], "micro": ["--gradient_accumulation_steps", "2"]}
    norms = {}
    for name, more in runs.items():
        assert cli.main(["train", FINETUNE, *common, f"run.name={name}", *more]) == 0
        events = EventAccumulator(str(tmp_path / "runs" / name / "tensorboard")).Reload()
        norms[name] = [event.value for event in events.Scalars("train/grad_norm")]
    assert len(norms["whole"]) == 3
    for name in ("workers", "micro"):
        assert norms[name] == pytest.approx(norms["whole"], rel=1e-4), norms
    whole = ckpt.load_model_weights(tmp_path / "runs" / "whole" / "checkpoint_00000003")
    for name in ("workers", "micro"):
        weights = ckpt.load_model_weights(tmp_path / "runs" / name / "checkpoint_00000003")
        for key in whole:
            torch.testing.assert_close(weights[key], whole[key], rtol=1e-4, atol=1e-6)


def test_the_tensor_plan_splits_each_adapted_layer_and_its_adapter_on_the_same_side(model_dir):
    from raytpu.parallel.tensor import tensor_plan, xla_partition_specs

    cfg, job = load_config(FINETUNE, words(model_dir, model_dir, "--use_peft", "--lora_target_modules", "all-linear"))
    model = job.build_model(cfg)
    plan = tensor_plan(model)
    layer = "base_model.model.model.layers.0"
    assert plan[f"{layer}.self_attn.q_proj.base_layer"] == plan[f"{layer}.self_attn.q_proj.lora_B.default"] == "colwise"
    assert plan[f"{layer}.mlp.down_proj.base_layer"] == plan[f"{layer}.mlp.down_proj.lora_A.default"] == "rowwise"
    assert f"{layer}.self_attn.q_proj.lora_A.default" not in plan  # r wide: whole on each device
    assert len(plan) == 2 * 7 * 2
    specs = xla_partition_specs(model, "fsdp", "tensor")
    assert specs[f"{layer}.self_attn.q_proj.lora_B.default.weight"] == ("tensor", "fsdp")
    assert specs[f"{layer}.mlp.down_proj.lora_A.default.weight"] == ("fsdp", "tensor")
    assert specs[f"{layer}.self_attn.q_proj.lora_A.default.weight"] == ("fsdp", None)


def test_lora_on_a_tensor_axis_follows_one_worker(model_dir, tmp_path):
    """Two local processes as one tensor group (each layer's base split, the adapter's matrix on the
    split side with it, the other whole), which read the same rows, against one worker that reads
    them alone: the same gradient norms step for step and the same adapters at the end (no dropout:
    beside a rowwise layer each device drops from its own slice of the inputs). The base stays frozen."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = write_rows(tmp_path / "c.jsonl", [conversation(i) for i in range(16)])
    lora = ["--use_peft", "--lora_dropout", "0", "--lora_target_modules", "all-linear", "--learning_rate", "1e-2"]
    common = [*words(model_dir, train, *lora), "--local", f"data.path={tmp_path / 'p'}", "--output_dir",
              str(tmp_path / "runs"), "data.global_batch_size=4", "loop.max_steps=4"]  # fmt: skip
    split_words = ["run.name=tensor", "scaling.num_workers=2", "sharding.mesh.tensor=2"]
    assert cli.main(["train", FINETUNE, *common, *split_words]) == 0
    assert cli.main(["train", FINETUNE, *common, "run.name=one"]) == 0
    norms = {}
    for name in ("tensor", "one"):
        events = EventAccumulator(str(tmp_path / "runs" / name / "tensorboard")).Reload()
        norms[name] = [event.value for event in events.Scalars("train/grad_norm")]
    assert len(norms["one"]) == 4 and norms["tensor"] == pytest.approx(norms["one"], rel=1e-4), norms
    split = ckpt.load_model_weights(tmp_path / "runs" / "tensor" / "checkpoint_00000004")
    whole = ckpt.load_model_weights(tmp_path / "runs" / "one" / "checkpoint_00000004")
    assert split.keys() == whole.keys() and all("lora_" in key for key in whole)
    for key in whole:
        torch.testing.assert_close(split[key], whole[key], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "rows, more, message",
    [
        ([{"messages": [{"role": "user", "content": "hi"}]}], ["--assistant_only_loss"],
         "a conversation with no assistant turn, and job.assistant_only_loss is set"),
        ([{"messages": [{"role": "robot", "content": "hi"}]}], [], "unknown role robot"),
        ([{"prompt": "2 + 2 ="}], [], "a row with a prompt needs a completion"),
        ([conversation(1)], ["--use_peft", "--lora_target_modules", "nothing_like_it"],
         r"job.lora_target_modules=\['nothing_like_it'\] matches no module of the model; its linear layers: .*q_proj"),
        ([conversation(1)], ["--use_peft", "--lora_dropout", "1.5"], r"job.lora_dropout=1.5 \(in \[0, 1\)\)"),
        ([conversation(1)], ["--use_peft", "xla.scan_layers=true"], "set --lora_dropout 0, or xla.scan_layers=false"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], ["--assistant_only_loss", "--streaming"],
         "bad.jsonl row 1: a conversation with no assistant turn"),
    ],
)  # fmt: skip
def test_bad_rows_and_settings_are_one_line(model_dir, tmp_path, capsys, rows, more, message):
    train = write_rows(tmp_path / "bad.jsonl", rows * 4)
    local = [] if "--streaming" in more else ["--local"]  # refused before any Ray instance either way
    code = cli.main(["train", FINETUNE, *words(model_dir, train, *more), *local, f"data.path={tmp_path / 'p'}",
                     "--output_dir", str(tmp_path / "runs")])  # fmt: skip
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("raytpu: error:")]
    assert code == 2 and len(errors) == 1 and re.search(message, errors[0]), errors
    assert not list(tmp_path.glob("runs/*/checkpoint_*"))


@pytest.mark.xla
@pytest.mark.parametrize("mesh", [["--fsdp", "full_shard"], ["sharding.mesh.fsdp=2", "sharding.mesh.tensor=2"]])
def test_packed_lora_fine_tuning_under_fsdpv2_compiles_one_step(model_dir, tmp_path, mesh):
    """On 4 XLA CPU devices under FSDPv2, and as (2 fsdp x 2 tensor), each layer's base and the
    adapter's matrix beside it annotated along the tensor axis: packed rows (their document masks made
    from the rows' segments, one shape), LoRA adapters on the frozen base; nothing compiles after
    warm-up, no CPU fallback, the loss falls, and the checkpoint holds the adapters alone."""
    from tests.conftest import XlaProbe

    train = write_rows(tmp_path / "c.jsonl", [conversation(i) for i in range(32)])
    flags = [*words(model_dir, train, "--packing", "--assistant_only_loss", "--use_peft", "--learning_rate", "1e-2"),
             f"data.path={tmp_path / 'p'}"]  # fmt: skip
    cfg, job = load_config(FINETUNE, flags)
    prepare_text(cfg, job)
    run = [*flags[:-1], "job.name=causal_lm", f"data.path={tmp_path / 'p'}", "xla.spmd=true", *mesh,
           "data.global_batch_size=4", "loop.max_steps=8", f"run.storage_path={tmp_path / 'runs'}", "run.name=xla",
           "checkpoint.every_steps=8"]  # fmt: skip
    (report,) = XlaProbe(4, [word for word in run if word != "scaling.runtime=cpu"]).reports()
    assert report["compiles_after_warmup"] == 0 and report["fallbacks_after_warmup"] == [], report
    assert report["losses"][-1] < report["losses"][0], report["losses"]
    weights = ckpt.load_model_weights(tmp_path / "runs" / "xla" / "checkpoint_00000008")
    assert weights and all("lora_" in key for key in weights), sorted(weights)[:4]


@pytest.mark.xla
def test_lora_on_scanned_layers_trains_as_on_unrolled_ones(model_dir, tmp_path):
    """On one XLA CPU device, the decoder layers scanned (their stacked base frozen, their stacked
    adapters training, the rows' document mask carried through the scan) against unrolled: the same
    losses, one compile; the checkpoint holds the adapters alone. (LoRA's dropout in a scan is refused:
    torch_xla's scan crashed the process on it.)"""
    from tests.conftest import XlaProbe

    train = write_rows(tmp_path / "c.jsonl", [conversation(i) for i in range(32)])
    flags = [*words(model_dir, train, "--use_peft", "--learning_rate", "1e-2"), f"data.path={tmp_path / 'p'}"]
    prepare_text(*load_config(FINETUNE, flags))
    run = [word for word in flags if word != "scaling.runtime=cpu"]
    run += ["job.name=causal_lm", "data.global_batch_size=4", "loop.max_steps=6", f"run.storage_path={tmp_path}"]
    run += ["--lora_dropout", "0"]
    unrolled, scanned = XlaProbe(
        1, [*run, "run.name=unrolled"], [*run, "xla.scan_layers=true", "run.name=scanned", "checkpoint.every_steps=6"]
    ).reports()
    assert scanned["losses"] == pytest.approx(unrolled["losses"], rel=1e-4), (scanned, unrolled)
    assert scanned["losses"][-1] < scanned["losses"][0]
    assert scanned["compiles_after_warmup"] == 0 and scanned["fallbacks_after_warmup"] == [], scanned
    weights = ckpt.load_model_weights(tmp_path / "scanned" / "checkpoint_00000006")
    assert weights and all("lora_" in key for key in weights), sorted(weights)[:4]
    assert len(weights) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj: peft's default for Qwen2) x (lora_A, lora_B)


def test_each_evaluation_continues_held_out_prompts_through_the_template(model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = write_rows(tmp_path / "c.jsonl", [conversation(i) for i in range(8)])
    flags = [*words(model_dir, train, "job.sample_tokens=4"), f"data.path={tmp_path / 'p'}", "loop.max_steps=2",
             "data.global_batch_size=4", "loop.eval_every_steps=2"]  # fmt: skip
    cfg, job = load_config(FINETUNE, flags)
    root = prepare_text(cfg, job)
    Trainer(
        cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), tmp_path / "run", root, FolderReporter(tmp_path / "run")
    ).fit()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    shown = [events.Tensors(f"valid/sample_{i}/text_summary")[-1].tensor_proto.string_val[0].decode() for i in (0, 1)]
    assert all(text.startswith("<|im_start|>") and "<|im_start|>assistant\n" in text for text in shown), shown


def test_streamed_rows_are_the_torch_path_s_rows_and_count_skip_and_hold_out_as_text_does(model_dir, tmp_path):
    """A file of conversations streamed (``raytpu.corpus.rows``: packed in a task, a group of rows at
    a time) gives the rows the torch path prepares from it, ids, labels, positions and segments; its
    count is its rows, a resumed read skips exactly, and a held-out share splits the rows in two."""
    from raytpu.corpus.index import Sources
    from raytpu.corpus.rows import RowPacking, rows_batch
    from raytpu.corpus.sources import find_units

    rows = [conversation(i) for i in range(40)] + [{"messages": [*conversation(1)["messages"]] * 12}]  # one cut
    train = write_rows(tmp_path / "c.jsonl", rows)
    cfg, job = load_config(FINETUNE, words(model_dir, train, "--packing", "--assistant_only_loss",
                                           f"data.path={tmp_path / 'p'}"))  # fmt: skip
    prepared = sft.Rows(prepare_text(cfg, job) / "sft-train", LENGTH, 0)
    packing = RowPacking(job.row_encoder(cfg, tmp_path / "p"), LENGTH)
    unit = find_units([str(train)], "data.train_files")[0]
    streamed = rows_batch(np.concatenate(list(packing.blocks(unit))))
    assert len(streamed["input_ids"]) == len(prepared) >= 2
    for index in range(len(prepared)):
        for name, value in prepared[index].items():
            assert torch.equal(streamed[name][index], value), (index, name)
    count = packing.count(unit)
    assert (count.blocks, count.documents, count.cut) == (len(prepared), 41, 1)
    whole = np.concatenate(list(packing.blocks(unit)))
    assert np.array_equal(np.concatenate(list(packing.blocks(unit, skip=1))), whole[1:])
    held, kept = Sources((unit,), (unit,), 25.0).packings(packing.encoder, LENGTH, "text")
    assert held.count(unit).documents + kept.count(unit).documents == 41 and kept.count(unit).documents


def test_positions_restart_at_each_document_and_padding_is_at_zero():
    from raytpu.corpus.rows import positions

    segments = np.array([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0]])
    assert positions(segments).tolist() == [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]]


@pytest.mark.integration
def test_streamed_conversations_on_two_ray_workers_take_the_torch_path_s_first_step(
    ray_session, model_dir, tmp_path, capsys
):
    """Conversations streamed by Ray Data (``--streaming``) to 2 Ray workers, packed, assistant-only
    loss, the whole set one global batch: the first step's loss is the torch path's on the same rows
    in one process; the evaluation continues held-out prompts through the template; a bad row deep
    in the file is one line naming it, from the task that read it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [conversation(i * 7) if i % 3 else {"messages": [*conversation(i)["messages"]] * 3} for i in range(24)]
    train = write_rows(tmp_path / "c.jsonl", rows)
    options = ["--packing", "--assistant_only_loss", "--learning_rate", "1e-3", "data.shuffle=false"]
    ours, count = first_step(model_dir, train, tmp_path, *options)
    code = cli.main(["train", FINETUNE, *words(model_dir, train, *options, "--streaming"), "scaling.num_workers=2",
                     f"data.path={tmp_path / 'streamed'}", "--output_dir", str(tmp_path / "runs"), "run.name=s",
                     f"data.global_batch_size={count}", "loop.max_steps=1", "job.sample_tokens=4"])  # fmt: skip
    assert code == 0
    metrics = json.loads((tmp_path / "runs" / "s" / "summary.json").read_text())["metrics"]
    assert metrics["train/loss"] == pytest.approx(ours, rel=1e-5)  # over both workers
    assert json.loads((tmp_path / "streamed" / sft.STREAMED / sft.PROMPTS).read_text())
    events = EventAccumulator(str(tmp_path / "runs" / "s" / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    shown = events.Tensors("valid/sample_0/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert shown.startswith("<|im_start|>") and "<|im_start|>assistant\n" in shown, shown
    bad = write_rows(tmp_path / "bad.jsonl", rows * 4 + [{"messages": [{"role": "robot", "content": "hi"}]}])
    code = cli.main(["train", FINETUNE, *words(model_dir, bad, "--streaming"), f"data.path={tmp_path / 'bad'}",
                     "--output_dir", str(tmp_path / "runs"), "run.name=bad"])  # fmt: skip
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("raytpu: error:")]
    assert code == 2 and errors == ["raytpu: error: bad.jsonl row 97: unknown role robot (roles: system, developer, "
                                    "user, assistant, tool)"], errors  # fmt: skip
