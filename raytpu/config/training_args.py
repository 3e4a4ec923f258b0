"""Hugging Face ``TrainingArguments`` names, as every job's flags (and a config's ``training_arguments:``).

Users of ``transformers.Trainer`` keep their command lines: each flag below sets the raytpu key
with the same meaning; the flags their scripts almost always carry but raytpu has no use for are
accepted with a one-line warning; the ones it does not take (:data:`REFUSED`) say what to use
instead; any other underscore flag is an error that names it. "Per device" means per data-parallel
replica (a worker on cpu/cuda, a chip on XLA), resolved into ``data.global_batch_size`` once the
runtime is known (:func:`raytpu.config.plan.per_device_batches`).
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytpu.config.args import Alias, ConfigError, Flag, warn

Pairs = list[tuple[str, Any]]

OPTIMIZERS = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_torch_xla": "adamw",
    "adamw_hf": "adamw",
    "adafactor": "adafactor",
    "sgd": "sgd",
    "adagrad": "adagrad",
}
#: ``--mixed_precision`` (Accelerate's names, as ``accelerate launch`` takes them) -> scaling.precision
ACCELERATE_PRECISIONS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8", "auto": "auto"}
SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}


def choice(flag: str, table: dict[str, str], key: str) -> Callable[[Any], Pairs]:
    def convert(value: Any) -> Pairs:
        if str(value) not in table:
            raise ConfigError(f"{flag} {value} is not supported; use one of {', '.join(table)}")
        return [(key, table[str(value)])]

    return convert


def whole_epochs(value: Any) -> Pairs:
    if not isinstance(value, (int, float)) or value <= 0 or float(value) != int(value):
        raise ConfigError(f"--num_train_epochs {value}: raytpu trains whole epochs; for part of one use --max_steps")
    return [("loop.epochs", int(value))]


def max_steps(value: Any) -> Pairs:
    return [("loop.max_steps", 0 if value == -1 else value)]  # -1: Transformers' "no limit"


def precision(name: str) -> Callable[[bool], Pairs]:
    """``--bf16`` / ``--fp16``: that precision; an explicit ``false``: full precision (fp32), as in Transformers."""
    return lambda on: [("scaling.precision", name if on else "fp32")]


def debug(value: Any) -> Pairs:
    pairs: Pairs = []
    for option in str(value).replace(",", " ").split():
        if option == "tpu_metrics_debug":
            pairs.append(("xla.debug_metrics", True))
        else:
            warn(f"--debug {option} is ignored: raytpu supports --debug tpu_metrics_debug")
    return pairs


def do_train(on: bool) -> Pairs:
    if not on:
        raise ConfigError("--do_train false: `raytpu train` trains; to only evaluate use `raytpu test`")
    return []


def overwrite_output_dir(on: bool) -> Pairs:
    """Transformers' examples resume from the newest checkpoint in the output folder unless told
    to overwrite it: raytpu's ``checkpoint.resume`` says the same."""
    return [("checkpoint.resume", not on)]


def eval_strategy(value: Any) -> Pairs:
    if value == "epoch":
        return [("loop.eval_every_steps", 0), ("loop.eval_every_epochs", 1)]
    if value != "steps":
        warn(f"--eval_strategy {value} is ignored: raytpu evaluates before every scored checkpoint")
    return []


def save_strategy(value: Any) -> Pairs:
    if value == "epoch":
        return [("checkpoint.every_steps", 0)]
    if value != "steps":
        warn(f"--save_strategy {value} is ignored: raytpu always checkpoints (it is how a run resumes)")
    return []


#: the --report_to integrations raytpu sends a run's scalars to (Transformers' names)
TRACKED = ("tensorboard", "mlflow", "wandb")


def report_to(value: Any) -> Pairs:
    """``--report_to`` as Transformers means it: the integrations named, ``all`` for every one that
    is installed, ``none`` for none (no TensorBoard either)."""
    targets = value if isinstance(value, list) else str(value).replace(",", " ").split()
    if targets in (["none"], []):
        return [("logging.report_to", []), ("logging.tensorboard", False)]
    if "all" in targets:
        targets = ["tensorboard", *(name for name in TRACKED[1:] if importlib.util.find_spec(name))]
    ignored = [target for target in targets if target not in TRACKED]
    if ignored:
        warn(f"--report_to {' '.join(ignored)} is ignored: raytpu reports to {', '.join(TRACKED)}")
    chosen = [target for target in targets if target in TRACKED]
    return [("logging.report_to", chosen), ("logging.tensorboard", "tensorboard" in chosen)]


def resume_from_checkpoint(value: Any) -> Pairs:
    """Transformers' ``--resume_from_checkpoint``: true/false, or the checkpoint whose whole training
    state the run starts from (``checkpoint.resume_from``)."""
    if isinstance(value, bool):
        return [("checkpoint.resume", value)]
    return [("checkpoint.resume_from", str(value))]


FSDP_MODES = {"full_shard", "shard_grad_op", "auto_wrap"}


def fsdp(value: Any) -> Pairs:
    """``--fsdp full_shard [auto_wrap]``: the model sharded on every runtime (``sharding.strategy``:
    FSDP2 on cpu and cuda, FSDPv2 over every device of the SPMD mesh on xla); ``""`` / ``false``: none."""
    words = value if isinstance(value, list) else str(value).replace(",", " ").split()
    if value is False or words in ([], ["false"], ["no"], ["none"]):
        return []
    unsupported = [word for word in words if word not in FSDP_MODES]
    if unsupported:
        raise ConfigError(
            f"--fsdp {' '.join(unsupported)} is not supported: raytpu shards with FSDP2 on cpu and cuda and "
            "FSDPv2 on xla (--fsdp full_shard; CPU offload and hybrid sharding are not offered)"
        )
    if "shard_grad_op" in words:
        warn("--fsdp shard_grad_op runs as full_shard: parameters, gradients and optimizer state are all sharded")
    return [("sharding.strategy", "full_shard")]


#: --fsdp_config keys (Transformers' names, without their fsdp_ prefix) -> raytpu keys
FSDP_CONFIG_KEYS = {
    "xla_fsdp_grad_ckpt": "sharding.activation_checkpointing",
    "activation_checkpointing": "sharding.activation_checkpointing",
    "transformer_layer_cls_to_wrap": "sharding.layers",
}


def fsdp_config(value: Any) -> Pairs:
    """``--fsdp_config`` as Transformers takes it: a JSON object, or a JSON file's path; keys may
    carry Transformers' ``fsdp_`` prefix. ``xla`` / ``xla_fsdp_v2`` / ``version`` need no key: the
    runtime picks FSDPv2 on xla and FSDP2 elsewhere."""
    settings = value if isinstance(value, dict) else read_json_object(str(value))
    settings = {key.removeprefix("fsdp_"): item for key, item in settings.items()}
    if settings.get("version") not in (None, 2, "2"):
        raise ConfigError(f"--fsdp_config version {settings['version']}: raytpu shards with FSDP2 (version 2) only")
    pairs: Pairs = []
    for key, item in settings.items():
        if key == "transformer_layer_cls_to_wrap":
            pairs.append(("sharding.layers", [item] if isinstance(item, str) else list(item)))
        elif key in FSDP_CONFIG_KEYS:
            pairs.append((FSDP_CONFIG_KEYS[key], bool(item)))
        elif key not in ("xla", "xla_fsdp_v2", "version"):
            warn(f"--fsdp_config {key} is ignored: raytpu shards each decoder layer (or the sharding.layers classes)")
    return pairs


def read_json_object(text: str) -> dict[str, Any]:
    try:
        settings = json.loads(Path(text).read_text()) if Path(text).is_file() else json.loads(text)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--fsdp_config {text!r} is neither a JSON object nor a JSON file ({exc})") from exc
    if not isinstance(settings, dict):
        raise ConfigError(f"--fsdp_config {text!r} is not a JSON object")
    return settings


def file_list(key: str) -> Callable[[Any], Pairs]:
    """``--train_file a.jsonl`` (or several, comma-separated): the list of files ``key`` holds."""

    def convert(value: Any) -> Pairs:
        files = value if isinstance(value, list) else [part.strip() for part in str(value).split(",") if part.strip()]
        return [(key, [str(item) for item in files])]

    return convert


#: TrainingArguments that raytpu does not take -> what to use instead (one line when given)
REFUSED = {
    "--tpu_num_cores": "a run uses every chip of the slices it gets (scaling.tpu.*, docs/runtimes-and-tpu.md)",
    "--local_rank": "Ray Train gives each worker its rank",
    "--deepspeed": "shard with --fsdp full_shard or the sharding.* keys (docs/sharding.md)",
    "--push_to_hub": "nothing is uploaded; raytpu export CONFIG --checkpoint best --out DIR writes a folder to push",
    "--hub_model_id": "nothing is uploaded; push what raytpu export writes",
    "--hub_token": "nothing is uploaded; push what raytpu export writes",
    "--use_cpu": "use scaling.runtime=cpu",
    "--no_cuda": "use scaling.runtime=cpu",
    "--load_best_model_at_end": "every run keeps its best checkpoint: raytpu test CONFIG --checkpoint best",
    "--metric_for_best_model": "the job's main metric picks the best checkpoint (docs/jobs.md)",
    "--greater_is_better": "the job's main metric says which way is better (docs/jobs.md)",
    "--logging_dir": "TensorBoard events go to the tensorboard/ folder of the run's own folder",
    "--do_predict": "evaluate a checkpoint with raytpu test CONFIG --checkpoint best",
    "--label_smoothing_factor": "a job's loss is its own: smooth the labels in the job's train_step",
    "--ddp_backend": "the runtime picks the backend (gloo on CPUs, NCCL on GPUs, XLA on TPUs)",
    "--half_precision_backend": "mixed precision is torch.autocast: --bf16 or --fp16",
    "--fp16_opt_level": "mixed precision is torch.autocast (no apex): --fp16",
    "--group_by_length": "batches are shuffled samples or packed blocks of job.seq_len tokens",
    "--log_level": "--verbose shows Ray's own log lines too",
}


#: flag -> raytpu key (or rule); docs/configuration.md's table lists the same
TRAINING_ARGUMENTS: dict[str, Alias] = {
    "--output_dir": "run.storage_path",
    "--run_name": "run.name",
    "--seed": "run.seed",
    "--per_device_train_batch_size": "data.per_device_train_batch_size",
    "--per_device_eval_batch_size": "data.per_device_eval_batch_size",
    "--dataloader_num_workers": "data.num_workers",
    "--gradient_accumulation_steps": "loop.grad_accum",
    "--learning_rate": "optim.lr",
    "--weight_decay": "optim.weight_decay",
    "--adam_beta1": "optim.betas.0",
    "--adam_beta2": "optim.betas.1",
    "--adam_epsilon": "optim.eps",
    "--optim": Flag(convert=choice("--optim", OPTIMIZERS, "optim.name"), sets="optim.name (adamw_torch -> adamw, ...)"),
    "--lr_scheduler_type": Flag(
        convert=choice("--lr_scheduler_type", SCHEDULERS, "optim.scheduler"), sets="optim.scheduler"
    ),
    "--warmup_steps": "optim.warmup_steps",
    "--warmup_ratio": "optim.warmup_ratio",
    "--max_grad_norm": "loop.clip_grad_norm",
    "--num_train_epochs": Flag(convert=whole_epochs, sets="loop.epochs (whole epochs)"),
    "--max_steps": Flag(convert=max_steps, sets="loop.max_steps (-1: none)"),
    "--logging_steps": "loop.log_every",
    "--eval_steps": "loop.eval_every_steps",
    "--save_steps": "checkpoint.every_steps",
    "--save_total_limit": "checkpoint.num_to_keep",
    "--bf16": Flag(switch=True, convert=precision("bf16"), sets="scaling.precision=bf16"),
    "--fp16": Flag(switch=True, convert=precision("fp16"), sets="scaling.precision=fp16"),
    "--mixed_precision": Flag(
        convert=choice("--mixed_precision", ACCELERATE_PRECISIONS, "scaling.precision"),
        sets="scaling.precision (Accelerate's no | fp16 | bf16 | fp8)",
    ),
    "--gradient_checkpointing": Flag(key="job.gradient_checkpointing", switch=True),
    "--tf32": Flag(key="scaling.tf32", switch=True),
    "--torch_compile": Flag(
        switch=True, convert=lambda on: [("loop.compile", "true" if on else "false")], sets="loop.compile"
    ),
    "--torch_compile_mode": Flag(
        convert=lambda mode: [("loop.compile", "true"), ("loop.compile_mode", str(mode))],
        sets="loop.compile=true, loop.compile_mode",
    ),
    "--torch_compile_backend": Flag(ignored="raytpu compiles with torch.compile's default backend, inductor"),
    "--fsdp": Flag(convert=fsdp, sets="sharding.strategy (full_shard, shard_grad_op, auto_wrap)"),
    "--fsdp_config": Flag(convert=fsdp_config, sets="sharding.* (a JSON file or object)"),
    # accelerate launch's ParallelismConfig sizes: the mesh's axes
    "--parallelism_config_dp_replicate_size": "sharding.mesh.data",
    "--parallelism_config_dp_shard_size": "sharding.mesh.fsdp",
    "--parallelism_config_tp_size": "sharding.mesh.tensor",
    "--auto_find_batch_size": Flag(key="loop.auto_find_batch_size", switch=True),
    "--debug": Flag(convert=debug, sets="xla.debug_metrics (tpu_metrics_debug)"),
    "--do_train": Flag(switch=True, convert=do_train, sets="nothing: raytpu train trains"),
    "--do_eval": Flag(switch=True, convert=lambda on: [], sets="nothing: raytpu evaluates at its eval steps"),
    "--overwrite_output_dir": Flag(switch=True, convert=overwrite_output_dir, sets="checkpoint.resume=false"),
    "--eval_strategy": Flag(convert=eval_strategy, sets="loop.eval_every_epochs / loop.eval_every_steps"),
    "--evaluation_strategy": Flag(convert=eval_strategy, sets="as --eval_strategy"),
    "--save_strategy": Flag(convert=save_strategy, sets="checkpoint.every_steps (epoch: 0)"),
    "--logging_strategy": Flag(ignored="raytpu logs every --logging_steps steps"),
    "--report_to": Flag(convert=report_to, sets="logging.report_to (tensorboard, mlflow, wandb, none)"),
    "--resume_from_checkpoint": Flag(
        convert=resume_from_checkpoint, sets="checkpoint.resume_from (a folder), or checkpoint.resume"
    ),
    # run_clm.py's data arguments: a text corpus of the user's (jobs that read text)
    "--train_file": Flag(convert=file_list("data.train_files"), text=True, sets="data.train_files"),
    "--validation_file": Flag(convert=file_list("data.validation_files"), text=True, sets="data.validation_files"),
    "--dataset_name": "data.dataset_name",
    "--dataset_config_name": "data.dataset_config_name",
    "--dataset_train_split": "data.dataset_train_split",  # TRL's ScriptArguments
    "--dataset_test_split": "data.dataset_test_split",
    "--dataset_split": "data.dataset_train_split",
    "--text_column_name": "data.text_column",
    "--validation_split_percentage": "data.validation_split_percentage",
    "--max_eval_samples": "data.max_eval_samples",
    "--streaming": Flag(
        switch=True, convert=lambda on: [("data.loader", "ray" if on else "torch")], sets="data.loader=ray"
    ),
    "--disable_tqdm": Flag(
        switch=True, convert=lambda on: [("logging.progress_bar", not on)], sets="logging.progress_bar=false"
    ),
    "--preprocessing_num_workers": Flag(ignored="raytpu tokenizes in Ray Data tasks on the cluster's spare CPUs"),
    "--overwrite_cache": Flag(ignored="raytpu makes the corpus index again whenever a file or option changed"),
    "--eval_accumulation_steps": Flag(ignored="raytpu sums evaluation statistics on the device"),
    "--save_safetensors": Flag(switch=True, ignored="raytpu always writes model.safetensors"),
    "--dataloader_pin_memory": Flag(switch=True, ignored="raytpu pins host memory where the runtime gains by it"),
    **{flag: Flag(refused=instead) for flag, instead in REFUSED.items()},
}


def warmup_steps(warmup: int, ratio: float, total_steps: int) -> int:
    """Transformers' rule: ``warmup_steps`` when set, else ``ceil(warmup_ratio x total steps)``."""
    return warmup if warmup > 0 else math.ceil(total_steps * ratio)
