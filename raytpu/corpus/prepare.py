"""A run on a user's corpus (``data.train_files``), on the driver: what ``raytpu train`` and
``raytpu test`` check and make before the workers start, and what the workers are given.

Before joining Ray (:func:`prepare_text`): the files found, the first documents of each side
read (a missing text column or a file that is not what it says is one error line, within
seconds), the tokenizer, and on the torch path the tokenized splits. After joining
(:func:`text_sizes`): the corpus index, counted by Ray Data tasks. When the run starts
(:func:`text_datasets`): the feeder that streams the training blocks, and the validation blocks
read once into the object store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raytpu.config import Config
from raytpu.corpus.index import CorpusIndex, Sources, corpus_index, find_sources, sample_texts
from raytpu.corpus.rows import RowEncoder
from raytpu.corpus.sources import documents, fingerprint, records
from raytpu.errors import ConfigError
from raytpu.job import Job, ReadsText, TakesRecords
from raytpu.storage.filesystems import is_remote


def is_text_run(cfg: Config, job: Job) -> bool:
    """A run on text: files named in ``data.train_files`` or a data set in ``data.dataset_name``, or a
    job that reads text streamed by Ray Data."""
    return bool(cfg.data.train_files or cfg.data.dataset_name) or streamed(cfg, job)


def streamed(cfg: Config, job: Job) -> bool:
    """Text streamed by Ray Data (``data.loader: ray``), not tokenized into files (torch)."""
    return cfg.data.loader == "ray" and isinstance(job, ReadsText)


def corpus_words(cfg: Config, job: Job, root: Path, blocks: int | None = None) -> str:
    """The corpus in a message's words: what names it, its training tokens where they were counted
    (the torch path's token files), the block length."""
    from raytpu.corpus.tokens import read_summary

    data = cfg.data
    named = f"data.dataset_name={data.dataset_name!r}" if data.dataset_name else f"data.train_files={data.train_files}"
    length = job.block_length(cfg) if isinstance(job, ReadsText) else 0
    tokens = ((read_summary(root) or {}).get("splits", {}).get("train") or {}).get("tokens")
    if blocks is not None:
        counted = f"{blocks:,} training blocks of {length} tokens"
    elif tokens is not None:
        counted = f"{tokens:,} training tokens, in blocks of {length}"
    else:
        counted = f"blocks of {length} tokens"
    return f"the corpus {named} ({counted})"


def text_root(cfg: Config, job: Job) -> Path:
    """The folder that keeps what raytpu makes of the corpus: the tokenizer it trained, the index
    or the token files (``data.path``; ``data/<job>`` when not given)."""
    if not isinstance(job, ReadsText):
        raise ConfigError(f"job {job.name!r} reads no text: data.train_files is for jobs that do (causal_lm)")
    if is_remote(cfg.data.path):
        raise ConfigError(
            f"data.path={cfg.data.path!r}: with data.train_files, data.path is the local folder where raytpu keeps "
            "the tokenizer and the corpus index (the corpus itself may be in a bucket)"
        )
    return Path(cfg.data.path or Path("data") / job.name).resolve()


def encoder_of(cfg: Config, job: Job, root: Path, sources: Sources) -> Any:
    assert isinstance(job, ReadsText)
    texts = sample_texts(sources.train, cfg.data.text_column)
    try:
        return job.text_encoder(cfg, root, texts, fingerprint(sources.train, cfg.data.text_column))
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def check_readable(sources: Sources, column: str) -> None:
    """The first documents of the first training and validation files, read now: a wrong file or
    column is found before anything starts."""
    for unit in {sources.train[0], sources.valid[0]} if sources.valid else {sources.train[0]}:
        next(iter(documents(unit, column)), None)


def prepare_text(cfg: Config, job: Job) -> Path:
    """Everything before joining Ray: the folder raytpu keeps the corpus's derived files in."""
    root = text_root(cfg, job)
    sources = find_sources(cfg, job)
    if takes_records(cfg, job, sources):  # the job reads, checks and tokenizes its rows itself
        assert isinstance(job, TakesRecords)
        try:
            if streamed(cfg, job):  # read and tokenized in the corpus path's tasks; the first rows now
                job.stream_records(cfg, root, sources)
            else:
                job.prepare_records(cfg, root, sources)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return root
    check_readable(sources, cfg.data.text_column)
    encoder = encoder_of(cfg, job, root, sources)
    if not streamed(cfg, job):
        from raytpu.corpus.tokens import tokenize_corpus

        tokenize_corpus(root, sources, encoder, cfg.data.text_column)
    return root


def takes_records(cfg: Config, job: Job, sources: Sources) -> bool:
    """Whether the job tokenizes the corpus's rows itself (:class:`~raytpu.job.TakesRecords`)."""
    if not isinstance(job, TakesRecords) or sources.train[0].format == "text":
        return job.takes_records(cfg, {}) if isinstance(job, TakesRecords) else False
    first = next((row for batch in records(sources.train[0]) for row in batch), {})
    return job.takes_records(cfg, first)


def text_index(cfg: Config, job: Job, root: Path) -> tuple[CorpusIndex, Any]:
    """The corpus index (counted by Ray Data tasks when the files or options changed) and the
    encoder: of text, or the job's of its rows."""
    assert isinstance(job, ReadsText)
    sources = find_sources(cfg, job)
    if takes_records(cfg, job, sources):
        assert isinstance(job, TakesRecords)
        encoder = job.row_encoder(cfg, root)
    else:
        encoder = encoder_of(cfg, job, root, sources)
    return corpus_index(root, sources, encoder, job.block_length(cfg), cfg.data.text_column), encoder


def text_sizes(cfg: Config, job: Job, root: Path, mode: str) -> dict[str, int]:
    """Blocks in each split a streamed run reads (after joining Ray): the training blocks, and the
    validation blocks evaluated (``data.max_eval_samples`` at most)."""
    index, encoder = text_index(cfg, job, root)
    limit = cfg.data.max_eval_samples
    valid = min(index.valid_blocks, limit) if limit else index.valid_blocks
    rows = isinstance(encoder, RowEncoder)
    if not index.train_blocks:
        less = "no row with a token to train on" if rows else "fewer tokens than one block"
        raise ConfigError(
            f"{corpus_words(cfg, job, root, 0)} holds {less}; add text or lower job.seq_len (--block_size)"
        )
    cut = sum(count.cut for count in index.train_counts)
    if cut and mode == "train":
        print(f"raytpu: {cut} training example(s) longer than {job.block_length(cfg)} tokens were cut", flush=True)
    return {"train": index.train_blocks, "valid": valid} if mode == "train" else {"test": valid}


def text_datasets(cfg: Config, job: Job, root: Path, mode: str, feeder: str) -> dict[str, Any]:
    """``TorchTrainer`` arguments of a streamed corpus: the validation blocks (read whole by every
    worker) and, to train, the feeder named ``feeder`` started on the training units."""
    from ray.train import DataConfig

    from raytpu.corpus.feeder import StreamSpec, start_feeder
    from raytpu.corpus.order import EpochOrder
    from raytpu.corpus.pipeline import numbered_blocks

    assert isinstance(job, ReadsText)
    index, encoder = text_index(cfg, job, root)
    length, column = job.block_length(cfg), cfg.data.text_column
    train, valid = index.sources.packings(encoder, length, column)
    counts = [count.blocks for count in index.valid_counts]
    blocks = numbered_blocks(index.sources.valid, counts, valid, cfg.data.max_eval_samples)
    split = "valid" if mode == "train" else "test"
    if mode == "train":
        train_counts = tuple(count.blocks for count in index.train_counts)
        data = cfg.data
        order = EpochOrder.make(train_counts, data.global_batch_size, data.shuffle_buffer, cfg.run.seed, data.shuffle)
        start_feeder(feeder, StreamSpec(index.sources.train, order, train))
    return {"datasets": {split: blocks}, "dataset_config": DataConfig(datasets_to_split=[])}
