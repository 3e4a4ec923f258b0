"""The contract between the library and a training job.

A job is a Python module (``raytpu.jobs.<name>`` or any importable dotted path) that exposes
``JOB``, an instance of a :class:`Job` subclass. The core every job has is small: a model,
datasets, a train step, summable eval statistics and the metrics made of them. Everything else
is an optional capability: a job has it when it defines that protocol's methods, and the library
asks with ``isinstance(job, Capability)`` (:class:`Synthesizes`, :class:`HasStatistics`,
:class:`Tabular`, :class:`Exports`, :class:`CustomTest`, :class:`CountsFlops`,
:class:`CountsTokens`, :class:`DrawsImages`, :class:`WritesText`, :class:`WarmsUp`).

The library never imports a job's model or data code directly: it only calls the methods below,
so adding a job never touches ``raytpu/``. Everything a job returns lives on the CPU or on
whatever device the library moved the batch to; jobs never pick a device, never import
torch_xla and never call ``.item()`` inside :meth:`Job.train_step`.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import Dataset

from raytpu.errors import install_hint

if TYPE_CHECKING:  # the config imports this module; the type is only for readers and checkers
    from raytpu.config import Config

Batch = dict[str, torch.Tensor]
#: a chunk of records as columns: 1-D arrays, (n, *shape) arrays for fixed-shape tensors, or lists of bytes/str
Columns = dict[str, Any]
#: turns decoded columns of one batch (and the epoch, for augmentation) into the Dataset's stacked items
BatchDecoder = Callable[[Columns, int], Batch]
#: the package that holds the jobs shipped with raytpu (the repository's ``jobs/`` folder)
SHIPPED = "raytpu.jobs"
#: records per parquet file of ``raytpu data prepare`` for a :class:`Tabular` job that names none
ROWS_PER_FILE = 256


@dataclass(frozen=True)
class JobConfig:
    """Job-specific settings, the ``job:`` section of a config file.

    Jobs subclass it as a frozen dataclass (``@dataclass(frozen=True)``; Python refuses a plain
    ``@dataclass`` subclass of a frozen one, and ``load_job`` says so in one line) and add their own
    fields (model size, augmentation, ...).
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


#: set while a model is built whose weights another rank sends (:func:`weights_arrive_later`)
EMPTY_BUILD = contextvars.ContextVar("raytpu_empty_build", default=False)


def weights_arrive_later() -> bool:
    """Whether the model being built gets its weights from elsewhere (a sharded run's rank 0 sends
    them): its parameters are made on the meta device, and a job that would read pretrained weights
    builds the same architecture from its config instead."""
    return EMPTY_BUILD.get()


@contextlib.contextmanager
def empty_build(real_buffers: bool = False) -> Iterator[None]:
    """Build a model whose weights arrive later (:func:`weights_arrive_later`), on the meta device;
    with ``real_buffers``, its parameters only (Accelerate's ``init_empty_weights``): the buffers a
    model computes as it is built (rotary frequencies) are in no checkpoint."""
    token = EMPTY_BUILD.set(True)
    try:
        if real_buffers:
            from accelerate import init_empty_weights

            with init_empty_weights(include_buffers=False):
                yield
        else:
            with torch.device("meta"):
                yield
    finally:
        EMPTY_BUILD.reset(token)


#: model built empty -> what finds the safetensors files its weights can be read from (:func:`reads_weights_from`)
WEIGHT_FILES: weakref.WeakKeyDictionary[nn.Module, Callable[[], list[Path]]] = weakref.WeakKeyDictionary()


def reads_weights_from(model: nn.Module, files: Callable[[], list[Path]]) -> nn.Module:
    """Say that ``model``, built empty, would be loaded from the safetensors files ``files()`` returns
    (a pretrained checkpoint's, under the model's parameter names, or ``[]`` where there are none): a
    sharded run's workers may then each read their own shard of every weight from them rather than
    take rank 0's whole model (:mod:`raytpu.parallel.reading`). ``files`` is called only then, on
    every worker, so that nothing is fetched where the model is only measured."""
    WEIGHT_FILES[model] = files
    return model


def weight_files_of(model: nn.Module) -> Callable[[], list[Path]] | None:
    return WEIGHT_FILES.get(model)


class Job:
    """Base class of every job: the core. Override the four step methods and the two builders."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[JobConfig]] = JobConfig
    #: metric used to keep the best checkpoint, as reported by :meth:`finish_eval`
    main_metric: ClassVar[str] = "loss"
    main_metric_mode: ClassVar[str] = "min"
    #: seed-script flags accepted on the command line: flag -> dotted config key
    aliases: ClassVar[dict[str, str]] = {}
    #: the job makes its samples itself (in memory: a notebook cell's tensors): a run needs no data
    #: folder (``data.path`` may stay unset)
    data_in_memory: ClassVar[bool] = False
    #: modules the job imports only when it uses them (Transformers, imported lazily so that the
    #: runtime decides about torch_xla first): checked when the job is loaded
    requires: ClassVar[tuple[str, ...]] = ()

    def replaced_in_file(self, in_file: dict[str, Any], typed: dict[str, Any]) -> set[str]:
        """The keys of the file's ``job:`` section that the command line's ``typed`` values (job
        keys, without ``job.``) replace whole, so that the file's value is dropped before the
        command line's apply (a model named on the command line replaces the file's model and its
        fields). The default: none."""
        return set()

    def check_config(self, cfg: Config) -> None:
        """Reject job settings that cannot work (raise ``ValueError`` with the fix), on the
        driver, before anything starts. The default accepts everything."""

    def build_model(self, cfg: Config) -> nn.Module:
        raise NotImplementedError

    def build_dataset(self, cfg: Config, split: str, data_root: Path) -> Dataset:
        """Map-style dataset for ``split`` in ``{"train", "valid", "test"}``.

        Items are dicts of tensors with fixed shapes per split. If the train set
        has ``set_epoch(epoch)``, it is called before the epoch's first item in
        whichever process reads it (a DataLoader worker keeps its own copy for the
        whole run), so that augmentation can be a pure function of (seed, epoch, index).
        """
        raise NotImplementedError

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


# ------------------------------------------------------------------ capabilities
@runtime_checkable
class HasCallbacks(Protocol):
    """Hooks the job adds to every run of it (``raytpu.hooks.Callback`` instances, made on each
    worker), beside the ones a config names in ``loop.callbacks``."""

    def callbacks(self, cfg: Config) -> list[Any]: ...


@runtime_checkable
class Synthesizes(Protocol):
    """``raytpu data synth``, and ``data.synthesize_if_missing``: a small data set in the job's layout."""

    def synthesize(self, out: Path, **options: Any) -> None: ...

    def synth_options(self, cfg: Config) -> dict[str, Any]:
        """Options for :meth:`synthesize` when a run makes its missing data set."""
        ...


@runtime_checkable
class HasStatistics(Protocol):
    """``raytpu data stats``: (re)compute the normalisation statistics of the data at ``root``
    from its train split; returns a summary."""

    def compute_stats(self, root: Path) -> dict[str, Any]: ...


@runtime_checkable
class Tabular(Protocol):
    """The Ray Data path (``data.loader: ray``): the job's records as parquet tables.

    Optional with it: ``table_for_split(cfg, split)``, the prepared table that serves a split
    (default: the table named as the split, :func:`table_for`), and two class attributes:
    ``rows_per_file``, the records per file ``raytpu data prepare`` writes (default
    :data:`ROWS_PER_FILE`), and ``stats_files``, files beside the native data (normalisation
    statistics) copied beside the tables (default none)."""

    def table_names(self, src: Path) -> list[str]:
        """Tables ``raytpu data prepare`` can write from the native data under ``src``."""
        ...

    def table_records(self, src: Path, table: str, rows: int) -> Iterator[Columns]:
        """Chunks of at most ``rows`` records of ``table``, read from the native files. Every chunk
        has an ``id`` column: the record's index in the job's map-style Dataset of that table, so
        both ingest paths see the same sample under one number (and draw the same augmentation)."""
        ...

    def batch_decoder(self, cfg: Config, split: str, stats_root: Path) -> BatchDecoder:
        """A function ``(columns, epoch) -> batch`` giving the same tensors as stacking
        ``build_dataset(cfg, split, ...)[id]`` after ``set_epoch(epoch)``; ``stats_root`` holds
        :attr:`stats_files`."""
        ...


@runtime_checkable
class ReadsText(Protocol):
    """Trains on a text corpus of the user's (``data.train_files``; ``raytpu.corpus``): its
    documents tokenized by the job's tokenizer, joined by its end-of-text token and cut into blocks
    of :meth:`block_length` tokens; every batch is ``{"input_ids": (n, length) int64}``, on both
    ingest paths. With ``data.loader: ray`` such a job always streams text (its own,
    :meth:`default_text`, when the user names none)."""

    def block_length(self, cfg: Config) -> int: ...

    def default_text(self, cfg: Config) -> tuple[list[str], list[str]]:
        """The training and validation files a run reads when ``data.train_files`` names none (the
        job's own made-up corpus): ``data.loader: ray`` streams text whichever it is."""
        ...

    def text_encoder(self, cfg: Config, data_root: Path, texts: Callable[[], Iterator[str]], source: str) -> Any:
        """The tokenizer as a ``raytpu.corpus.packing.TextEncoder`` (picklable): the job's own, or
        one trained on ``texts`` (the training documents, read lazily) and kept in ``data_root``;
        ``source`` names the training files (a trained tokenizer is made again when they change)."""
        ...


@runtime_checkable
class TakesRecords(Protocol):
    """A text job that also trains on rows of fields (conversations, prompts and completions: TRL's
    formats), which it tokenizes itself: into the data root on the driver (the torch path), or in
    the streamed path's tasks through its :meth:`row_encoder` (``data.loader: ray``); its batches
    then carry ``labels`` (the tokens the loss skips at -100), ``position_ids`` and ``segments``
    (each row's documents)."""

    def takes_records(self, cfg: Config, first: dict[str, Any]) -> bool:
        """Whether the corpus, of which ``first`` is the first training row, is such rows."""
        ...

    def prepare_records(self, cfg: Config, data_root: Path, sources: Any) -> None:
        """Tokenize the training and validation rows of ``sources`` into ``data_root`` (left as they
        are when made from the same rows and settings)."""
        ...

    def row_encoder(self, cfg: Config, data_root: Path) -> Any:
        """The streamed path's :class:`~raytpu.corpus.rows.RowEncoder` of the run's rows."""
        ...

    def stream_records(self, cfg: Config, data_root: Path, sources: Any) -> None:
        """Before a streamed run's workers start: check the first rows of ``sources`` (a bad one
        raises ``ValueError``) and keep in ``data_root`` what its evaluations need."""
        ...


@runtime_checkable
class Exports(Protocol):
    """``raytpu export``: write the trained ``model`` (weights loaded, on the CPU) to ``out`` in the
    format its ecosystem loads (a Transformers ``save_pretrained`` folder, ...)."""

    def export(self, model: nn.Module, cfg: Config, data_root: Path, out: Path) -> None: ...


@runtime_checkable
class CustomTest(Protocol):
    """A job-specific test mode run on rank 0 (a diffusion sampler), instead of evaluating the test
    split with :meth:`Job.eval_step` on every worker; returns the test metrics."""

    def test(self, model: nn.Module, cfg: Config, run_dir: Path, data_root: Path) -> dict[str, float]: ...


@runtime_checkable
class CountsFlops(Protocol):
    """Model FLOPs utilisation (``perf/mfu``): the training FLOPs of one sample at ``cfg``'s shapes,
    the model's matmuls in a forward and a backward pass, i.e. 3x the forward's
    (``raytpu.worker.flops``). ``model``: the model just built, on the CPU, to count parameters of."""

    def flops_per_sample(self, cfg: Config, model: nn.Module) -> float | None: ...


@runtime_checkable
class CountsTokens(Protocol):
    """``perf/tokens_per_s``: tokens in one sample (a causal LM: its sequence length)."""

    def tokens_per_sample(self, cfg: Config) -> int | None: ...


@runtime_checkable
class AveragesOverItems(Protocol):
    """A loss that is a mean over items whose number varies from batch to batch (a fine-tuning
    run's trained tokens: the labels not masked out). The step's loss is then the mean over all the
    items of its batches, on every worker and micro-batch, as Transformers' Trainer takes it
    (``average_tokens_across_devices``), not the mean of each batch's mean
    (``raytpu.worker.optim``). ``None``: this batch's items are as many as any other's."""

    def loss_items(self, batch: Batch) -> torch.Tensor | None: ...


@runtime_checkable
class EstimatesActivations(Protocol):
    """Bytes of activations one device keeps for the backward of a step of ``batch`` samples, its
    values ``value_bytes`` wide (2 in bf16, 4 in fp32); ``checkpointed``: each unit keeps only its
    input, and one unit's activations exist at a time in the backward; ``compiled``: the model runs
    through ``torch.compile``, which keeps fewer (``raytpu.config.memory``)."""

    def activation_bytes(
        self, cfg: Config, batch: int, value_bytes: int, checkpointed: bool, compiled: bool = False
    ) -> float: ...


@runtime_checkable
class DrawsImages(Protocol):
    """Images for TensorBoard at each evaluation: name -> (N, C, H, W) in [0, 1]."""

    def eval_images(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class WritesText(Protocol):
    """Text for TensorBoard at each evaluation (a generated sample), run on rank 0: name -> text."""

    def eval_text(self, model: nn.Module, ctx: StepContext, data_root: Path) -> dict[str, str]: ...


@runtime_checkable
class WarmsUp(Protocol):
    """A warm-up phase that trains another output than the rest of the run (MSHNet trains its
    level-0 head alone). During its first ``warmup_epochs(cfg)`` epochs some parameters get no
    gradient (data-parallel wrappers are told to look for them), and evaluations of the weights
    those epochs made are logged but never chosen as the best checkpoint."""

    def warmup_epochs(self, cfg: Config) -> int: ...


def table_for(job: Job, cfg: Config, split: str) -> str:
    """The prepared table that serves ``split`` (``train``, ``valid``, ``test``) of a :class:`Tabular` job."""
    chooser = getattr(job, "table_for_split", None)
    return chooser(cfg, split) if chooser is not None else split


def in_warmup(job: Job, cfg: Config, epoch: int) -> bool:
    """Whether ``epoch`` (from 0) is one of the job's warm-up epochs (never, for a job without one)."""
    return isinstance(job, WarmsUp) and epoch < job.warmup_epochs(cfg)


# ------------------------------------------------------------------ finding a job
def job_module(name: str) -> str:
    """The module of job ``name``: a dotted name is one already; an undotted one is a shipped job
    (``mshnet`` -> ``raytpu.jobs.mshnet``) or else a top-level module of the user's (``my_job``
    for ``./my_job.py``)."""
    if "." in name:
        return name
    shipped = f"{SHIPPED}.{name}"
    return name if not importable(shipped) and importable(name) else shipped


#: jobs handed to the Python API as objects (``raytpu.train(cfg, job=MyJob())``), by name: they are
#: found before any module, and travel to the workers by value (:func:`job_by_value`)
GIVEN: dict[str, Job] = {}


def give(job: Job) -> Job:
    """Make ``job`` the job of its name in this process (:data:`GIVEN`)."""
    if not isinstance(job, Job):
        raise ValueError(f"job={job!r}: pass an instance of a raytpu.job.Job subclass, or a job's name")
    GIVEN[job.name] = job
    return job


def job_by_value(name: str) -> str:
    """A given job pickled by value (cloudpickle, base64) for another process, or "" for a job that
    any process finds by its name. A class defined in a notebook cell or a script's ``__main__``
    has no module the workers could import, so its code travels with it."""
    job = GIVEN.get(name)
    if job is None:
        return ""
    import base64

    import cloudpickle

    module = importlib.import_module(type(job).__module__)
    if module.__name__ != "__main__" and not module.__name__.startswith(f"{SHIPPED}."):
        cloudpickle.register_pickle_by_value(module)
    return base64.b64encode(cloudpickle.dumps(job)).decode()


def take_job(text: str) -> None:
    """Give this process the job that :func:`job_by_value` packed ("" : none)."""
    if text:
        import base64
        import pickle

        give(pickle.loads(base64.b64decode(text)))


def load_job(name: str) -> Job:
    """Resolve ``name`` to a job (a given one, else :func:`job_module`); a mistake is a
    ``ValueError`` that says how to fix it."""
    if name in GIVEN:
        return GIVEN[name]
    module_name = job_module(name)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not (exc.name and module_name.startswith(exc.name)):
            raise missing_dependency(exc, name) from exc
        raise ValueError(unknown_job(name, module_name)) from None
    except TypeError as exc:
        if "frozen" not in str(exc):
            raise
        raise ValueError(f"{where_raised(exc, module_name)}: {exc}: {FROZEN_FIX}") from None
    job = getattr(module, "JOB", None)
    if not isinstance(job, Job):
        raise ValueError(f"module {module_name!r} has no JOB = <Job instance>; add one to plug the job in")
    for required in job.requires:
        if not importable(required):
            raise missing_dependency(ModuleNotFoundError(name=required), name)
    return job


#: how to declare a job's config class, when Python refused the declaration
FROZEN_FIX = (
    "declare the job's config class @dataclass(frozen=True), as raytpu.job.JobConfig is "
    "(configs are frozen: change them with overrides or dataclasses.replace)"
)


def unknown_job(name: str, module_name: str) -> str:
    """The answer to a job name that names no module, with how to name one's own."""
    if "." in name:
        return f"unknown job {name!r}: no module {module_name} on the path (raytpu runs from {Path.cwd()})"
    return (
        f"unknown job {name!r}: not a shipped job ({', '.join(known_jobs())}) and no module {name} on the path; "
        f"name a job of your own by its module path from the folder raytpu runs in "
        f"({name} for ./{name}.py, mypkg.{name} for ./mypkg/{name}.py)"
    )


def where_raised(exc: BaseException, module_name: str) -> str:
    """``file:line`` of the job module's line that raised ``exc`` (the class declaration), else the module."""
    spec = importlib.util.find_spec(module_name)
    origin = spec.origin if spec else None
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == origin]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else f"job module {module_name}"


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


#: the extra that installs what a shipped job imports (``pip install -e '.[<extra>]'``)
EXTRAS = {"mshnet": "mshnet", "cdeit": "cdeit", "causal_lm": "lm"}


def missing_dependency(exc: ModuleNotFoundError, name: str) -> Exception:
    """A job whose own dependency is not installed: one line naming the extra that installs it."""
    extra = EXTRAS.get(name.removeprefix(f"{SHIPPED}."))
    fix = install_hint(extra) if extra else f"install {exc.name}"
    return ValueError(f"job {name!r} needs the package {exc.name!r}, which is not installed: {fix}")


def known_jobs() -> list[str]:
    """Jobs shipped with raytpu."""
    try:
        package = importlib.import_module(SHIPPED)
    except ModuleNotFoundError:
        return []
    roots = [Path(p) for p in getattr(package, "__path__", [])]
    return sorted({p.name for root in roots for p in root.iterdir() if (p / "__init__.py").exists()})
