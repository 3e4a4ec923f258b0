"""The configuration's typed sections: what a config file and the command line can set.

Every section is a frozen dataclass: a config is read once (``raytpu.config.loading``) and never
changed afterwards; a changed value is a new config (:func:`raytpu.config.loading.with_values`),
and what the driver works out from it is the plan (``raytpu.config.plan``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raytpu.job import JobConfig


@dataclass(frozen=True)
class RunSettings:
    name: str = ""
    storage_path: str = "./results"
    seed: int = 0
    mode: str = "train"  # train | test


@dataclass(frozen=True)
class TPUSettings:
    accelerator_type: str = ""  # e.g. TPU-V5LITEPOD, TPU-V4, TPU-V6E
    topology: str = ""  # e.g. 2x4
    layout: str = "spmd"  # spmd | multiprocess
    # the slices of that type the workers form; MIN:MAX for an elastic run, whose unit is a whole slice
    slices: int = 1
    min_slices: int = 0  # the smallest number of slices of an elastic run (set by slices: MIN:MAX; 0: fixed)


@dataclass(frozen=True)
class ScalingSettings:
    runtime: str = "auto"  # auto | cpu | cuda | xla | torch_tpu
    num_workers: int = 1  # workers; MIN:MAX (or [MIN, MAX]) for an elastic run, whose largest size this keeps
    min_workers: int = 0  # the smallest size of an elastic run (set by num_workers: MIN:MAX; 0: a fixed size)
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 | fp8 (float8 linear layers: GPUs of compute capability 8.9+)
    fp8_recipe: str = "tensorwise"  # fp8's scaling: tensorwise (faster) | rowwise (more accurate)
    tf32: bool = True  # cuda: TF32 tensor cores for the matmuls and convolutions left in fp32
    device_memory_gb: float = 0.0  # each device's memory for the estimate (0: the device's own, or its kind's)
    check_memory: bool = True  # refuse a run estimated above 90% of each device's memory (false: start it anyway)
    cpus_per_worker: float = 1.0
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    tpu: TPUSettings = field(default_factory=TPUSettings)
    # how long a run waits for an autoscaler to start the nodes its workers need (Ray's autoscaler
    # gives a node 15 minutes to start: AUTOSCALER_NODE_START_WAIT_S)
    node_start_timeout_s: float = 900.0


@dataclass(frozen=True)
class XLASettings:
    spmd: bool = False
    # the model's repeated blocks (sharding.layers, its decoder layers) run as one scanned block: one
    # layer compiled, not N (torch_xla's scan_layers; docs/sharding.md)
    scan_layers: bool = False
    compile_cache: str = ""  # "" = <run dir>/xla_cache; "none" disables it
    strict_recompile: bool = False
    debug_metrics: bool = False


@dataclass(frozen=True)
class MeshSettings:
    """The device mesh's axes (``raytpu.parallel.mesh``): over the workers on cpu and cuda, over every
    device of the SPMD program on xla; -1 = the devices the other axes leave (formerly xla.mesh)."""

    data: int = -1  # model replicas, each with its share of the batch
    fsdp: int = 1  # devices each parameter is sharded over (--fsdp full_shard: all of them)
    tensor: int = 1  # devices each layer's matrix products are split over (tensor parallelism)


@dataclass(frozen=True)
class ShardingSettings:
    """The model sharded over the data-parallel workers: FSDP2 (``fully_shard``) on cpu and cuda,
    FSDPv2 over the SPMD mesh's ``fsdp`` axis on xla (docs/sharding.md)."""

    strategy: str = "none"  # none | full_shard (--fsdp full_shard)
    # the units sharded one by one, by class name ([] = the model's _no_split_modules: decoder layers);
    # formerly xla.fsdp_layers
    layers: list[str] = field(default_factory=list)
    # recompute each unit's activations in the backward (formerly xla.grad_ckpt; --gradient_checkpointing)
    activation_checkpointing: bool = False
    mesh: MeshSettings = field(default_factory=MeshSettings)


@dataclass(frozen=True)
class DataSettings:
    path: str = ""
    synthesize_if_missing: bool = False
    global_batch_size: int = 8
    eval_batch_size: int = 0  # 0 = global_batch_size
    # TrainingArguments' per-device batches (0 = unused): x data-parallel replicas (x grad_accum) = the global batch
    per_device_train_batch_size: int = 0
    per_device_eval_batch_size: int = 0
    num_workers: int = 0  # DataLoader processes per Ray worker
    loader: str = "torch"  # torch | ray
    shuffle: bool = True
    prefetch_batches: int = 2  # data.loader=ray: batches each worker decodes ahead (in as many threads)
    # data.loader=ray: local shuffle buffer rows per worker (0 = 8 x per-worker batch); a text corpus: the
    # blocks shuffled together, in whole global batches (0 = 8 global batches)
    shuffle_buffer: int = 0
    materialize_mb: float = 1024  # data.loader=ray: a train set this small is read once, reshuffled each epoch
    # a text corpus of your own, for jobs that read text (causal_lm): files, folders or glob patterns of
    # .jsonl/.json, .parquet, .txt/.md/.py or a datasets save_to_disk folder, local, gs:// or s3:// (--train_file)
    train_files: list[str] = field(default_factory=list)
    validation_files: list[str] = field(default_factory=list)  # [] = held out of train_files (--validation_file)
    # a data set by name (--dataset_name): a Hugging Face Hub repository (org/name) or a folder in its
    # layout (its files, by split, as data.train_files and data.validation_files), or a save_to_disk folder
    dataset_name: str = ""
    dataset_config_name: str = ""  # the data set's config (--dataset_config_name)
    dataset_train_split: str = "train"  # the split trained on (--dataset_train_split)
    dataset_test_split: str = ""  # the split evaluated on; "" = validation, valid, val or test (--dataset_test_split)
    text_column: str = "text"  # the field / column that holds the text (--text_column_name)
    validation_split_percentage: float = 5.0  # documents held out when no validation files are named
    max_eval_samples: int = 0  # blocks of the validation text each evaluation reads (0 = all)


@dataclass(frozen=True)
class OptimSettings:
    name: str = "adamw"  # adafactor | adagrad | adam | adamw | sgd
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8  # adam / adamw
    scheduler: str = "constant"  # constant | cosine | linear | poly
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # used when warmup_steps is 0: ceil(ratio x total steps) warm-up steps
    min_lr_ratio: float = 0.0
    # the base lr from each step on ({0: 0.01, 40: 0.012}; {} = optim.lr throughout), the schedule's
    # shape applied to it: what a population-based sweep's best.yaml writes of its winner's lr
    lr_changes: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LoopSettings:
    epochs: int = 1
    max_steps: int = 0  # 0 = epochs * steps per epoch
    grad_accum: int = 1
    auto_find_batch_size: bool = False  # halve the per-device batch (doubling grad_accum) on out-of-memory
    clip_grad_norm: float = 0.0  # 0 = no clipping
    ema_beta: float = 0.0  # 0 = no EMA of the weights; else the decay it reaches
    ema_every: int = 1  # steps between EMA updates
    ema_update_after: int = 100  # steps during which the EMA copies the weights (ema_pytorch's default)
    ema_warmup: bool = True  # ramp the decay as 1 - (1 + n)^-ema_power up to ema_beta (false: ema_beta at once)
    ema_power: float = 2 / 3
    log_every: int = 10
    eval_every_epochs: int = 1
    eval_every_steps: int = 0  # evaluate every that many steps instead (TrainingArguments' eval_steps)
    sync_batchnorm: str = "auto"  # auto | true | false: BatchNorm over the global batch (docs/configuration.md)
    stop_on_nonfinite: bool = True
    profile_steps: list[int] = field(default_factory=list)  # [first, last]: trace these steps (from 1); [] = none
    profile_ranks: list[int] = field(default_factory=lambda: [0])  # the ranks that trace them
    grad_norm_warn_high: float = 1e3
    grad_norm_warn_low: float = 1e-7
    callbacks: list[str] = field(default_factory=list)  # raytpu.hooks.Callback classes by import path
    compile: str = "auto"  # auto | true | false: torch.compile of the model on cpu/cuda (auto: on cuda)
    compile_mode: str = "default"  # torch.compile's mode: default | reduce-overhead | max-autotune ...


@dataclass(frozen=True)
class CheckpointSettings:
    every_steps: int = 0  # 0 = at the end of every epoch
    num_to_keep: int = 2
    resume: bool = True  # continue from the run's latest checkpoint when there is one
    weights: str = ""  # checkpoint dir or weights file to start from / to test
    # a checkpoint whose whole training state (weights, optimizer, schedule, step, data position) the
    # run starts from, instead of its own checkpoints of earlier commands (--resume_from_checkpoint PATH)
    resume_from: str = ""
    max_failures: int = 0


@dataclass(frozen=True)
class LoggingSettings:
    tensorboard: bool = True
    progress_bar: bool = True
    eval_images: int = 4  # images per eval written to TensorBoard (0 = none)
    verbose: bool = False  # show Ray's own INFO lines (reports, checkpoints, scheduling) too
    hparams: bool = True  # the config's values in TensorBoard's HPARAMS tab once training completes
    flush_every_s: float = 60.0  # a run in a bucket: its TensorBoard events copied up this often (0: at evals only)
    # where the run's scalars go: tensorboard | mlflow | wandb (--report_to; docs/tracking.md)
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    experiment: str = ""  # MLflow experiment / W&B project ("": MLFLOW_EXPERIMENT_NAME / WANDB_PROJECT, else raytpu)
    mlflow_tracking_uri: str = ""  # "": MLFLOW_TRACKING_URI, else an SQLite file beside the runs of a local storage
    wandb_mode: str = ""  # online | offline | disabled ("": WANDB_MODE, else online)
    mlflow_parent_run: str = ""  # set by raytpu tune: the sweep's MLflow run, each trial's parent
    wandb_group: str = ""  # set by raytpu tune: the sweep's W&B group


@dataclass(frozen=True)
class TuneSettings:
    """``raytpu tune``: what to search and how (the CLI flags set the same keys)."""

    search: dict[str, str] = field(default_factory=dict)  # key -> "loguniform(1e-4, 1e-1)"
    num_samples: int = 4
    metric: str = ""  # "" = valid/<the job's main metric>
    mode: str = ""  # max | min; "" = the job's
    search_alg: str = "random"  # random (and grid) | optuna (TPE, learning from the finished trials)
    scheduler: str = "asha"  # asha | fifo | pbt
    max_t: int = 0  # ASHA horizon in reports (eval rounds); 0 = the reports a full trial makes
    grace_period: int = 1
    reduction_factor: float = 2.0
    max_concurrent: int = 0  # 0 = as many as the cluster's resources fit
    name: str = ""  # "" = <run.name>-tune; the same name resumes the sweep
    lr_scaling: str = "none"  # none | linear | sqrt, relative to reference_batch_size
    reference_batch_size: int = 0  # 0 = the config's data.global_batch_size
    perturbation_interval: int = 1  # pbt: reports between two looks at the population
    quantile_fraction: float = 0.25  # pbt: the share of the population that copies the best (at most 0.5)
    mutations: dict[str, str] = field(default_factory=dict)  # pbt: key -> domain it may take; {} = optim.lr's


@dataclass(frozen=True)
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    run: RunSettings = field(default_factory=RunSettings)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    xla: XLASettings = field(default_factory=XLASettings)
    sharding: ShardingSettings = field(default_factory=ShardingSettings)
    data: DataSettings = field(default_factory=DataSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    loop: LoopSettings = field(default_factory=LoopSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    tune: TuneSettings = field(default_factory=TuneSettings)
