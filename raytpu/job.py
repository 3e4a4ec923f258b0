"""The contract between the library and a training job.

A job is a Python module (``jobs.<name>`` or any importable dotted path) that
exposes ``JOB``, an instance of a :class:`Job` subclass. The library never
imports a job's model or data code directly: it only calls the methods below,
so adding a job never touches ``raytpu/``.

Everything a job returns lives on the CPU or on whatever device the library
moved the batch to; jobs never pick a device, never import torch_xla and never
call ``.item()`` inside :meth:`Job.train_step`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils.data import Dataset

if TYPE_CHECKING:  # config.py imports this module; the type is only for readers and checkers
    from raytpu.config import Config

Batch = dict[str, torch.Tensor]
#: a chunk of records as columns: 1-D arrays, (n, *shape) arrays for fixed-shape tensors, or lists of bytes/str
Columns = dict[str, Any]
#: turns decoded columns of one batch (and the epoch, for augmentation) into the Dataset's stacked items
BatchDecoder = Callable[[Columns, int], Batch]


@dataclass
class JobConfig:
    """Job-specific settings, the ``job:`` section of a config file.

    Jobs subclass it and add their own fields (model size, augmentation, ...).
    """

    name: str = ""


@dataclass
class StepContext:
    """What a step may depend on besides the batch. Plain Python values only,
    so that on XLA a change of value is a (bounded) graph change, never a sync."""

    epoch: int  # training: the step's epoch; eval of valid: the epoch whose training made the weights
    step: int
    training: bool
    config: Config | None = None  # the run's full config (static for the whole run)
    split: str = "train"  # train, valid or test


class Job:
    """Base class of every job; override what the job needs."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[JobConfig]] = JobConfig
    #: metric used to keep the best checkpoint, as reported by :meth:`finish_eval`
    main_metric: ClassVar[str] = "loss"
    main_metric_mode: ClassVar[str] = "min"
    #: seed-script flags accepted on the command line: flag -> dotted config key
    aliases: ClassVar[dict[str, str]] = {}

    # ----------------------------------------------------------------- build
    def check_config(self, cfg: Config) -> None:
        """Reject job settings that cannot work (raise ``ValueError`` with the fix), on the
        driver, before anything starts. The default accepts everything."""

    def build_model(self, cfg: Config) -> nn.Module:
        raise NotImplementedError

    def build_dataset(self, cfg: Config, split: str, data_root: Path) -> Dataset:
        """Map-style dataset for ``split`` in ``{"train", "valid", "test"}``.

        Items are dicts of tensors with fixed shapes per split. If the dataset
        has ``set_epoch(epoch)``, the loop calls it before every epoch so that
        augmentation can be a pure function of (seed, epoch, index).
        """
        raise NotImplementedError

    def synthesize(self, out: Path, **options: Any) -> None:
        """Write a small data set in the job's native layout under ``out``."""
        raise NotImplementedError(f"job {self.name!r} has no synthetic data generator")

    def compute_stats(self, root: Path) -> dict[str, Any]:
        """``raytpu data stats``: (re)compute the normalisation statistics of the data at ``root``
        from its train split and return a summary; jobs without statistics keep this default."""
        raise ValueError(f"job {self.name!r} has no normalisation statistics to compute")

    def synth_options(self, cfg: Config) -> dict[str, Any]:
        """Options for :meth:`synthesize` when the config asks to synthesize missing data."""
        return {}

    # ------------------------------------------------- tables (the Ray Data path)
    #: records per parquet file written by ``raytpu data prepare`` (``--rows-per-file 0``)
    rows_per_file: ClassVar[int] = 256
    #: files beside the native data (normalisation statistics) copied beside the tables
    stats_files: ClassVar[tuple[str, ...]] = ()

    def table_names(self, src: Path) -> list[str]:
        """Tables ``raytpu data prepare`` can write from the native data under ``src``."""
        raise NotImplementedError(f"job {self.name!r} cannot be prepared for data.loader=ray")

    def table_for_split(self, cfg: Config, split: str) -> str:
        """The prepared table that serves ``split`` (``train``, ``valid``, ``test``)."""
        return split

    def table_records(self, src: Path, table: str, rows: int) -> Iterator[Columns]:
        """Chunks of at most ``rows`` records of ``table``, read from the native files.

        Every chunk has an ``id`` column: the record's index in the job's map-style
        Dataset of that table, so both ingest paths see the same sample under one
        number (and draw the same augmentation for it).
        """
        raise NotImplementedError(f"job {self.name!r} cannot be prepared for data.loader=ray")

    def batch_decoder(self, cfg: Config, split: str, stats_root: Path) -> BatchDecoder:
        """A function ``(columns, epoch) -> batch`` giving the same tensors as stacking
        ``build_dataset(cfg, split, ...)[id]`` after ``set_epoch(epoch)``; ``stats_root``
        holds :attr:`stats_files`."""
        raise NotImplementedError(f"job {self.name!r} cannot decode prepared tables")

    # ------------------------------------------------------------------ step
    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> tuple[torch.Tensor, Batch]:
        """Return ``(loss, extra)``: a scalar loss to minimise and a dict of
        scalar tensors to log (kept on device; the library reads them lazily)."""
        raise NotImplementedError

    def eval_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> Batch:
        """Return a dict of *summable* statistics for one batch (tensors of any
        fixed shape). The library sums them over batches and workers and hands
        the totals to :meth:`finish_eval`."""
        raise NotImplementedError

    def finish_eval(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        """Turn summed statistics into the reported metrics."""
        raise NotImplementedError

    def unused_parameters(self, cfg: Config, epoch: int) -> bool:
        """Whether some parameters get no gradient in ``epoch`` (heads a warm-up skips): DDP then
        has to look for them, which it is asked to do in those epochs only."""
        return False

    def counts_for_best(self, cfg: Config, epoch: int) -> bool:
        """Whether an evaluation of weights trained up to ``epoch`` may be chosen as the best
        checkpoint (a job whose early phase trains another output, like MSHNet's warm-up, says
        no for it: those evaluations are logged, never the best)."""
        return True

    # ------------------------------------------------------------ throughput
    def flops_per_sample(self, cfg: Config, model: nn.Module) -> float | None:
        """Training FLOPs of one sample at ``cfg``'s shapes: the model's matmuls in a forward and a
        backward pass, i.e. 3x the forward's (what :mod:`raytpu.flops` counts, for model FLOPs
        utilisation). ``model``: the model just built, on the CPU, to count parameters of. The
        default, ``None``, declares nothing: no ``perf/mfu``."""
        return None

    def tokens_per_sample(self, cfg: Config) -> int | None:
        """Tokens in one sample (a causal LM: its sequence length), for ``perf/tokens_per_s``.
        The default, ``None``: the job's throughput is in samples/s only."""
        return None

    def eval_images(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        """Optional images for TensorBoard at eval: name -> (N, C, H, W) in [0, 1]."""
        return {}

    def eval_text(self, model: nn.Module, ctx: StepContext, data_root: Path) -> dict[str, str]:
        """Optional text for TensorBoard at eval (a generated sample), run on rank 0: name -> text."""
        return {}

    def export(self, model: nn.Module, cfg: Config, data_root: Path, out: Path) -> None:
        """``raytpu export``: write the trained ``model`` (weights loaded, on the CPU) to ``out`` in the
        format its ecosystem loads (a Transformers ``save_pretrained`` folder, ...)."""
        raise NotImplementedError

    def test(self, model: nn.Module, cfg: Config, run_dir: Path, data_root: Path) -> dict[str, float]:
        """Optional job-specific test mode, run on rank 0 (e.g. a diffusion sampler).

        Jobs that do not override it are tested by evaluating the test split
        with :meth:`eval_step` on every worker."""
        raise NotImplementedError


def load_job(name: str) -> Job:
    """Resolve ``name`` to a job: ``mshnet`` -> ``jobs.mshnet``, or a dotted module path."""
    candidates = [name] if "." in name else [f"jobs.{name}", name]
    errors = []
    for module_name in candidates:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                errors.append(module_name)
                continue
            raise
        job = getattr(module, "JOB", None)
        if not isinstance(job, Job):
            raise ValueError(f"module {module_name!r} has no JOB = <Job instance>; add one to plug the job in")
        return job
    raise ValueError(f"unknown job {name!r}: no module {' or '.join(errors)}; known jobs: {', '.join(known_jobs())}")


def known_jobs() -> list[str]:
    """Jobs shipped in the ``jobs`` package."""
    try:
        package = importlib.import_module("jobs")
    except ModuleNotFoundError:
        return []
    roots = [Path(p) for p in getattr(package, "__path__", [])]
    return sorted({p.name for root in roots for p in root.iterdir() if (p / "__init__.py").exists()})
