"""The Transformers causal-LM job: corpus and tokenizer, the model's own loss, TrainingArguments
flags, learning on 2 Ray workers with a resume, export to ``from_pretrained`` (its XLA step: ``tests/test_fsdp.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch
import yaml
from safetensors.torch import load_file

from raytpu import cli
from raytpu.config import load_config
from raytpu.config.args import ConfigError
from raytpu.config.plan import resolve_config
from raytpu.hooks import Callback
from raytpu.jobs.causal_lm import corpus
from raytpu.records import checkpoints as ckpt
from raytpu.runtime import make_runtime
from raytpu.storage.run_folder import RunFolder
from raytpu.worker.cadence import Cadence
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter
from tests.conftest import ROOT, run_python
from tests.stores import BUCKET

SMALL = str(ROOT / "jobs" / "causal_lm" / "small.yaml")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("causal_lm") / "data"
    corpus.synthesize(root, vocab_size=4096)
    return root


def test_corpus_is_pinned_and_its_tokenizer_loads_with_auto_tokenizer(data):
    from transformers import AutoTokenizer

    summary = json.loads((data / corpus.CORPUS_FILE).read_text())
    assert list(summary["splits"]["valid"]["files"]) == list(corpus.STDLIB_FILES["valid"])
    assert summary["vocab_size"] == 4096
    tokenizer = AutoTokenizer.from_pretrained(str(data))
    text = "def f(x):\n    return x ** 2  # é\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level: any text round-trips
    train = corpus.read_tokens(data, "train")
    assert train.dtype == np.uint16 and int(train.max()) < 4096
    assert int((train == tokenizer.eos_token_id).sum()) == len(corpus.STDLIB_FILES["train"])  # one EOS per file


def test_packed_blocks_are_consecutive_fixed_length_slices():
    blocks = corpus.PackedBlocks(np.arange(10, dtype=np.uint16), 4)
    assert len(blocks) == 2
    assert blocks[1]["input_ids"].tolist() == [4, 5, 6, 7] and blocks[1]["input_ids"].dtype == torch.int64
    with pytest.raises(IndexError):
        blocks[2]


class LossLog(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, trainer, step: int, values: dict[str, float]) -> None:
        self.losses.append(values["loss"])


def test_the_step_loss_is_the_transformers_model_loss(data, tmp_path):
    """raytpu does not re-implement the loss: its first logged loss is ``model(ids, labels=ids).loss``
    of the same model (same seed) on the same first batch."""
    overrides = [f"data.path={data}", "scaling.num_workers=1", "data.global_batch_size=4", "loop.max_steps=1"]
    overrides += ["loop.log_every=1", "logging.progress_bar=false", "job.sample_tokens=0", "data.eval_batch_size=128"]
    cfg, job = load_config(SMALL, overrides)
    log = LossLog()
    runtime = make_runtime("cpu", "auto", 1, 0, 0)
    Trainer(cfg, job, runtime, tmp_path, data, FolderReporter(tmp_path), callbacks=[log]).fit()
    dataset = job.build_dataset(cfg, "train", data)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    ids = torch.stack([dataset[i]["input_ids"] for i in list(sampler)[:4]])
    torch.manual_seed(0)
    model = job.build_model(cfg)
    with torch.no_grad():
        expected = float(model(input_ids=ids, labels=ids).loss)
    assert log.losses == [pytest.approx(expected, rel=1e-6)]


def flags(*words: str):
    cfg, _ = load_config(SMALL, list(words))
    return cfg


#: every TrainingArguments flag, and the raytpu setting it gives
MAPPED = [
    (["--output_dir", "/tmp/out"], "run.storage_path", "/tmp/out"),
    (["--run_name", "lm"], "run.name", "lm"),
    (["--seed", "7"], "run.seed", 7),
    (["--per_device_train_batch_size", "4"], "data.per_device_train_batch_size", 4),
    (["--per_device_eval_batch_size", "8"], "data.per_device_eval_batch_size", 8),
    (["--dataloader_num_workers", "2"], "data.num_workers", 2),
    (["--gradient_accumulation_steps", "4"], "loop.grad_accum", 4),
    (["--learning_rate", "3e-4"], "optim.lr", 3e-4),
    (["--weight_decay", "0.01"], "optim.weight_decay", 0.01),
    (["--adam_beta1", "0.8"], "optim.betas", [0.8, 0.95]),
    (["--adam_beta2", "0.99"], "optim.betas", [0.9, 0.99]),
    (["--adam_epsilon", "1e-6"], "optim.eps", 1e-6),
    (["--max_grad_norm", "0.5"], "loop.clip_grad_norm", 0.5),
    (["--num_train_epochs", "3.0"], "loop.epochs", 3),
    (["--max_steps", "50"], "loop.max_steps", 50),
    (["--max_steps", "-1"], "loop.max_steps", 0),
    (["--warmup_steps", "5"], "optim.warmup_steps", 5),
    (["--warmup_ratio", "0.1"], "optim.warmup_ratio", 0.1),
    (["--lr_scheduler_type", "linear"], "optim.scheduler", "linear"),
    (["--lr_scheduler_type", "constant_with_warmup"], "optim.scheduler", "constant"),
    (["--logging_steps", "5"], "loop.log_every", 5),
    (["--eval_steps", "20"], "loop.eval_every_steps", 20),
    (["--save_steps", "40"], "checkpoint.every_steps", 40),
    (["--save_total_limit", "3"], "checkpoint.num_to_keep", 3),
    (["--optim", "adamw_torch"], "optim.name", "adamw"),
    (["--optim", "adamw_torch_xla"], "optim.name", "adamw"),
    (["--optim", "adafactor"], "optim.name", "adafactor"),
    (["--optim", "sgd"], "optim.name", "sgd"),
    (["--debug", "tpu_metrics_debug"], "xla.debug_metrics", True),
    (["--bf16"], "scaling.precision", "bf16"),
    (["--bf16", "True"], "scaling.precision", "bf16"),
    (["--bf16=false"], "scaling.precision", "fp32"),
    (["--fp16"], "scaling.precision", "fp16"),
    (["--gradient_checkpointing"], "job.gradient_checkpointing", True),
    (["--tf32", "false"], "scaling.tf32", False),
    (["--torch_compile"], "loop.compile", "true"),
    (["--torch_compile", "false"], "loop.compile", "false"),
    (["--torch_compile_mode", "max-autotune"], "loop.compile_mode", "max-autotune"),
    (["--torch_compile_mode", "reduce-overhead"], "loop.compile", "true"),
    (["--auto_find_batch_size"], "loop.auto_find_batch_size", True),
    (["--overwrite_output_dir"], "checkpoint.resume", False),
    (["--do_train", "--do_eval"], "run.mode", "train"),
    (["--eval_strategy", "epoch"], "loop.eval_every_steps", 0),
    (["--save_strategy", "epoch"], "checkpoint.every_steps", 0),
    (["--report_to", "none"], "logging.tensorboard", False),
    (["--report_to", "tensorboard"], "logging.tensorboard", True),
    (["--resume_from_checkpoint", "false"], "checkpoint.resume", False),
    (["--resume_from_checkpoint", "out/checkpoint-500"], "checkpoint.resume_from", "out/checkpoint-500"),
]


@pytest.mark.parametrize(("words", "key", "value"), MAPPED, ids=[" ".join(m[0]) for m in MAPPED])
def test_training_arguments_flags_map_to_raytpu_keys(words, key, value):
    cfg = flags(*words)
    for part in key.split("."):
        cfg = getattr(cfg, part)
    assert cfg == value


def test_a_bare_boolean_flag_does_not_eat_the_next_flag():
    cfg = flags("--bf16", "--learning_rate", "1e-3", "--gradient_checkpointing", "optim.weight_decay=0.2")
    assert (cfg.scaling.precision, cfg.optim.lr, cfg.job.gradient_checkpointing) == ("bf16", 1e-3, True)
    assert cfg.optim.weight_decay == 0.2


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--label_smoothing_factor", "0.1"], "--label_smoothing_factor is not supported by raytpu: a job.s loss"),
        (["--optim", "adamw_bnb_8bit"], "--optim adamw_bnb_8bit is not supported"),
        (["--lr_scheduler_type", "cosine_with_restarts"], "is not supported"),
        (["--num_train_epochs", "0.5"], "whole epochs"),
        (["--bf16=maybe"], "flag --bf16 takes no value or true/false"),
        (["--do_train", "false"], "raytpu test"),
    ],
)
def test_unsupported_training_arguments_are_errors_that_name_them(words, message):
    with pytest.raises(ConfigError, match=message):
        flags(*words)


@pytest.mark.parametrize(
    "words",
    [
        ["--logging_strategy", "steps"],
        ["--torch_compile_backend", "inductor"],
        ["--eval_strategy", "no"],
        ["--save_strategy", "best"],
        ["--report_to", "comet_ml"],
        ["--debug", "underflow_overflow"],
    ],
)
def test_habitual_flags_without_a_use_are_ignored_with_one_warning(words, capsys):
    flags(*words)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"raytpu: warning: {words[0]} ") and "ignored" in lines[0]


def test_training_arguments_section_in_yaml_and_the_command_line_wins(tmp_path):
    config = tmp_path / "lm.yaml"
    config.write_text(
        "job: {name: causal_lm}\n"
        "training_arguments: {learning_rate: 0.0005, bf16: true, adam_beta2: 0.98, gradient_accumulation_steps: 2}\n"
    )
    cfg, _ = load_config(config, ["--learning_rate", "1e-4"])
    assert (cfg.optim.lr, cfg.scaling.precision, cfg.optim.betas[1], cfg.loop.grad_accum) == (1e-4, "bf16", 0.98, 2)


@pytest.mark.parametrize(
    ("scaling", "expected"),
    [
        (["scaling.runtime=cpu", "scaling.num_workers=2"], (4 * 2 * 3, 8 * 2)),  # per worker
        (["scaling.runtime=cuda", "scaling.num_workers=4"], (4 * 4 * 3, 8 * 4)),
        # SPMD on a v5e-8 (one host, 8 chips): per chip
        (
            [
                "scaling.runtime=xla",
                "scaling.num_workers=1",
                "scaling.tpu.accelerator_type=TPU-V5LITEPOD",
                "scaling.tpu.topology=2x4",
            ],
            (4 * 8 * 3, 8 * 8),
        ),  # fmt: skip
        # one process per chip of a v4-16 (2 hosts, 8 chips)
        (
            [
                "scaling.runtime=xla",
                "scaling.num_workers=8",
                "scaling.tpu.accelerator_type=TPU-V4",
                "scaling.tpu.topology=2x2x2",
                "scaling.tpu.layout=multiprocess",
            ],
            (4 * 8 * 3, 8 * 8),
        ),  # fmt: skip
    ],
)
def test_per_device_batch_times_replicas_times_accumulation_is_the_global_batch(scaling, expected):
    per_device = ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8"]
    cfg = flags(*scaling, *per_device, "--gradient_accumulation_steps", "3")
    resolved = resolve_config(cfg, cfg.scaling.runtime, "fp32")
    assert (resolved.data.global_batch_size, resolved.data.eval_batch_size) == expected


def test_per_device_batch_on_xla_without_a_slice_says_what_to_set():
    cfg = flags("scaling.runtime=xla", "--per_device_train_batch_size", "4")
    with pytest.raises(ConfigError, match="scaling.tpu.accelerator_type"):
        resolve_config(cfg, "xla", "bf16")


def test_eval_steps_and_save_steps_that_differ():
    """Evaluate every 20 steps, checkpoint every 40: every checkpoint has an eval (a score); with
    save_steps not a multiple, a checkpoint between evals carries none."""
    cadence = Cadence(total_steps=100, every_steps=40, eval_every_epochs=1, eval_every_steps=20)
    decided = {step: cadence.decide(step, False, 0) for step in (20, 40, 60, 80, 100)}
    assert decided == {20: (True, False), 40: (True, True), 60: (True, False), 80: (True, True), 100: (True, True)}
    assert Cadence(100, 30, 1, 20).decide(30, False, 0) == (False, True)


def test_llama3_8b_config_has_the_llama3_8b_parameter_count():
    cfg, job = load_config(str(ROOT / "jobs" / "causal_lm" / "llama3-8b.yaml"))
    with torch.device("meta"):
        model = job.build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert cfg.job.gradient_checkpointing and cfg.data.per_device_train_batch_size == 2


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("job.model_type=vit", "not a Transformers causal-LM architecture"),
        ("job.model_type=lama", "did you mean llama"),
        ("job.model_config.hiden_size=64", "did you mean hidden_size"),
        ("job.seq_len=512", "exceeds the model's 256 positions"),
        ("job.model_name_or_path=/nonexistent", "is no folder here, nor a Hugging Face Hub name"),
    ],
)
def test_bad_model_settings_fail_before_anything_runs(override, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        flags(override)


@pytest.mark.parametrize(
    "words, expected",
    [
        (["job.model_config.num_hidden_layers=3"], {"num_hidden_layers": 3}),
        (["job.model_config.rms_norm_eps=1e-5"], {"rms_norm_eps": 1e-5}),  # YAML 1.1 reads a string
        (["job.model_config.initializer_range=1"], {"initializer_range": 1.0}),  # a float field
        (["--config_overrides", "num_hidden_layers=2,hidden_act=gelu"], {"num_hidden_layers": 2, "hidden_act": "gelu"}),
    ],
)
def test_transformers_config_fields_from_the_command_line_typed_by_its_class(words, expected):
    from raytpu.jobs.causal_lm import architecture

    config = architecture(flags(*words).job)
    for name, value in expected.items():
        assert getattr(config, name) == value and type(getattr(config, name)) is type(value), name


def test_a_model_config_field_set_on_the_command_line_trains_and_exports(data, tmp_path, stores):
    """``job.model_config.num_hidden_layers=3`` trains a 3-layer model: the run's config.yaml and
    the export's config.json say 3, and the checkpoint holds exactly three layers; the same
    checkpoint exported from a bucket gives the same files."""
    three = "job.model_config.num_hidden_layers=3"
    where = [f"data.path={data}", f"run.storage_path={tmp_path}", "run.name=three", "job.sample_tokens=0"]
    short = ["scaling.num_workers=1", "data.global_batch_size=4", "loop.max_steps=2", "logging.progress_bar=false"]
    assert cli.main(["train", SMALL, three, *where, *short, "--local"]) == 0
    run = tmp_path / "three"
    assert yaml.safe_load((run / "config.yaml").read_text())["job"]["model_config"]["num_hidden_layers"] == 3
    checkpoint = sorted(run.glob("checkpoint_0*"))[-1]
    layers = {key.split(".")[2] for key in load_file(checkpoint / ckpt.MODEL) if key.startswith("model.layers.")}
    assert layers == {"0", "1", "2"}
    out = tmp_path / "export"
    assert (
        cli.main(["export", SMALL, three, f"data.path={data}", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    )
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3
    bucket = RunFolder(f"s3://{BUCKET}/export-{tmp_path.name}")
    pafs.copy_files(str(checkpoint), bucket.path(checkpoint.name), destination_filesystem=bucket.fs)
    remote = ["--checkpoint", bucket.uri(checkpoint.name), "--out", str(tmp_path / "from-bucket")]
    assert cli.main(["export", SMALL, three, f"data.path={data}", *remote]) == 0
    exported = (tmp_path / "from-bucket" / "model.safetensors").read_bytes()
    assert exported == (out / "model.safetensors").read_bytes()


# ------------------------------------------------------------------ training on Ray
#: 20 steps of 32 blocks x 128 tokens at a constant lr; an eval every 10 steps, a checkpoint every
#: 10, all kept (whether the recipe learns past unigram statistics is bench/learning.py's)
TRAIN = ["loop.max_steps=20", "loop.log_every=5", "--eval_steps", "10", "--save_steps", "10", "--warmup_steps", "10",
         "--lr_scheduler_type", "constant", "--save_total_limit", "8", "logging.progress_bar=false",
         "job.sample_tokens=8"]  # fmt: skip


def scalars(run_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    return [event.value for event in events.Scalars(tag)]


@pytest.fixture(scope="module")
def trained(ray_session, data, tmp_path_factory):
    """small.yaml on 2 Ray workers, failing once at step 13 and restarted by Ray Train (it resumes
    from the step-10 checkpoint; a failed command run again resumes the same way: test_faults.py),
    and the same run uninterrupted in local processes to step 20: 10 steps past the resume, where
    anything the resume left out (weights, optimizer moments, data position) has already changed
    the weights (the constant lr does not depend on the run's length)."""
    out = tmp_path_factory.mktemp("lm-runs")
    faulty = out / "faulty.yaml"  # small.yaml with the causal LM that can fail at a step
    faulty.write_text(Path(SMALL).read_text().replace("name: causal_lm\n", "name: tests.faulty_lm\n", 1))
    where = [f"data.path={data}", "--output_dir", str(out)]
    (out / "seen").mkdir()  # where the job marks its one failure (and records its steps' blocks)
    once = ["job.fail_at_step=13", f"job.seen_dir={out / 'seen'}", "checkpoint.max_failures=2"]
    assert cli.main(["train", str(faulty), *TRAIN, *where, "--run_name", "ray", *once]) == 0
    assert (out / "seen" / "failed").is_file()
    assert cli.main(["train", str(faulty), *TRAIN, *where, "--run_name", "local", "--local"]) == 0
    return out


def test_two_ray_workers_train_and_resume_exactly(trained, data):
    run = trained / "ray"
    losses = scalars(run, "train/loss")
    assert losses[-1] < losses[0] - 0.5, losses  # from ~ln(4096) = 8.3
    assert len(scalars(run, "valid/perplexity")) == 2
    final = sorted(run.glob("checkpoint_0*"))[-1]
    assert final.name == "checkpoint_00000020"
    local = sorted((trained / "local").glob("checkpoint_0*"))[-1]
    assert local.name == "checkpoint_00000020"
    straight, resumed = load_file(local / ckpt.MODEL), load_file(run / local.name / ckpt.MODEL)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)


def test_a_generated_sample_is_in_tensorboard_at_each_eval(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained / "ray" / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    samples = events.Tensors("valid/sample/text_summary")
    assert len(samples) >= 2
    assert samples[-1].tensor_proto.string_val[0].decode().startswith("def ")


def test_export_loads_with_from_pretrained_and_generates(trained, data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    best = sorted((trained / "ray").glob("checkpoint_0*"))[-1]
    out = tmp_path / "export"
    code = cli.main(["export", SMALL, "--checkpoint", str(best), "--out", str(out), f"data.path={data}"])
    assert code == 0
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer("import os\ndef ", return_tensors="pt")["input_ids"]
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 8)
    assert tokenizer.decode(generated[0]).startswith("import os\ndef ")
    cfg, job = load_config(SMALL, [f"data.path={data}"])
    ours = job.build_model(cfg)
    ours.load_state_dict(ckpt.load_model_weights(best))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ours.eval()(ids).logits)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("attention", ["causal", "sdpa"])
def test_the_eval_sample_is_transformers_greedy_generate(data, attention):
    from raytpu.jobs.causal_lm import generate
    from raytpu.jobs.causal_lm.attention import attention_implementation

    model, tokenizer = tiny_llama(), corpus.load_tokenizer(data)
    model.set_attn_implementation(attention_implementation(attention))
    ids = tokenizer("def ", return_tensors="pt")["input_ids"]
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert generate(model, tokenizer, "def ", 12) == tokenizer.decode(expected[0])


@pytest.mark.xla
def test_the_eval_sample_compiles_a_fixed_number_of_graphs_on_xla(data):
    """As many graphs for 20 tokens as for 4 (two: measured), none when an evaluation samples again;
    Transformers' generate compiled 21 graphs for 8 tokens here."""
    code = f"""
import json, torch_xla, torch_xla.debug.metrics as met
from raytpu.jobs.causal_lm import corpus, generate
from tests.test_causal_lm import tiny_llama
model, tokenizer = tiny_llama().to(torch_xla.device()), corpus.load_tokenizer({str(data)!r})
compiles = lambda: (met.metric_data("CompileTime") or [0])[0]
counts = []
for tokens in (4, 20, 20):
    before = compiles()
    generate(model, tokenizer, "def ", tokens)
    counts.append(compiles() - before)
print(json.dumps(counts))
"""
    done = run_python(["-c", code], env={"PJRT_DEVICE": "CPU"})
    assert done.returncode == 0, done.stderr[-3000:]
    short, long, again = json.loads(done.stdout.strip().splitlines()[-1])
    assert short == long <= 2 and again == 0, (short, long, again)


def test_export_without_a_checkpoint_is_a_one_line_error(capsys):
    assert cli.main(["export", SMALL, "--out", "/tmp/x"]) == 2
    expected = "raytpu: error: export needs --checkpoint PATH (a checkpoint folder or weights file)"
    assert capsys.readouterr().err.strip() == expected


def test_flops_per_sample_is_palms_count_for_the_small_model():
    """Hand count for small.yaml: N = 4 layers x (attention with GQA + 3 x 128 x 384 MLP + 2 norms)
    + the final norm + the 4096 x 128 output head (the input embedding is a lookup, not counted)."""
    cfg, job = load_config(SMALL)
    model = job.build_model(cfg)
    attention = 128 * 128 * 2 + 128 * 64 * 2  # q and o: 128 -> 128; k and v: 128 -> 2 heads x 32
    matmuls = 4 * (attention + 3 * 128 * 384 + 2 * 128) + 128 + 4096 * 128
    per_token = 6 * matmuls + 12 * 4 * 128 * 128
    assert job.flops_per_sample(cfg, model) == per_token * 128
    assert job.tokens_per_sample(cfg) == 128


def test_export_errors_are_one_line(trained, data, capsys):
    checkpoint = str(sorted((trained / "ray").glob("checkpoint_0*"))[-1])
    assert cli.main(["export", "jobs/mshnet/small.yaml", "--checkpoint", checkpoint, "--out", "/tmp/x"]) == 2
    assert "job 'mshnet' has no export format" in capsys.readouterr().err
    narrower = ["job.model_config={hidden_size: 64, num_attention_heads: 4}", "--checkpoint", checkpoint]
    assert cli.main(["export", SMALL, f"data.path={data}", *narrower, "--out", "/tmp/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("raytpu: error: ") and "does not hold weights of this config's model" in err
    assert len(err.splitlines()) == 1
