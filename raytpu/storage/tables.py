"""Ray Data ingest (``data.loader: ray``): parquet tables streamed to the workers.

``raytpu data prepare JOB --src DIR --out DIR`` writes, under a local folder or
any pyarrow filesystem URI (``gs://``, ``s3://``, ``file://``)::

    <out>/<table>/part-00000.parquet ...   one table per split, `id` = the record's Dataset index
    <out>/mean.pth, std.pth ...            the job's stats_files (normalisation statistics)
    <out>/_raytpu_prepared.json            the manifest, written last: the only proof of completeness

While it writes, ``<out>/_raytpu_partial`` marks the folder as raytpu's and
unfinished; a folder without the manifest is never read.

The driver reads the tables with ``ray.data.read_parquet`` and hands them to
``TorchTrainer(datasets=..., dataset_config=...)`` (``raytpu.driver.ray_trainer``): the train set (held in the
object store and reshuffled globally each epoch when small, else streamed with
its files shuffled) is split over the workers (``streaming_split(equal=True)``), eval sets are read whole by
every worker, which keeps the rows ``id % workers == rank`` (the torch path's
eval split, so metrics match it exactly). On a worker, ``raytpu.worker.data.RayData``
reads them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytpu.errors import ConfigError
from raytpu.job import ROWS_PER_FILE, Batch, BatchDecoder, Columns, Job, ReadsText, Tabular
from raytpu.storage.filesystems import filesystem

MANIFEST = "_raytpu_prepared.json"
PARTIAL = "_raytpu_partial"
FORMAT = "raytpu-parquet/1"


# ------------------------------------------------------------- filesystem
def open_fs(location: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it (``raytpu.storage.filesystems``)."""
    return filesystem(location)


def _exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def _read_json(fs: pafs.FileSystem, path: str) -> dict[str, Any] | None:
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as stream:
        return json.loads(stream.read().decode())


def _write_bytes(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as stream:
        stream.write(data)


# ---------------------------------------------------------------- prepare
def prepare(job: Job, src: str | Path, out: str, rows_per_file: int = 0) -> dict[str, Any]:
    """Write ``job``'s native data under ``src`` as parquet tables in ``out``; returns the manifest.

    Idempotent: a complete output made from the same source files (names, sizes,
    mtimes) and options is left as it is (the manifest comes back with
    ``unchanged: true``); anything else is rewritten from scratch.
    """
    if isinstance(job, ReadsText):
        raise ConfigError(
            f"job {job.name!r} reads text: data.loader=ray streams it from its files as they are "
            "(data.train_files; docs/data.md), with nothing to prepare"
        )
    if not isinstance(job, Tabular):
        raise ConfigError(f"job {job.name!r} has no parquet tables (the Tabular capability): use data.loader=torch")
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"--src {str(src)!r} is not a folder of {job.name} data")
    rows = rows_per_file or getattr(job, "rows_per_file", ROWS_PER_FILE)
    stats = tuple(getattr(job, "stats_files", ()))
    if rows < 1:
        raise ValueError(f"--rows-per-file must be at least 1, got {rows}")
    fs, base = open_fs(out)
    fingerprint = source_fingerprint(job, src, rows)
    current = _read_json(fs, f"{base}/{MANIFEST}")
    if current is not None and current.get("fingerprint") == fingerprint:
        return {**current, "unchanged": True}
    tables = job.table_names(src)
    if not tables:
        raise ValueError(f"{src} holds no {job.name} data to prepare; make some with `raytpu data synth {job.name}`")
    _claim(fs, base, out)
    manifest: dict[str, Any] = {"format": FORMAT, "job": job.name, "source": str(src.resolve())}
    manifest.update(fingerprint=fingerprint, rows_per_file=rows, tables={}, stats=list(stats))
    for table in tables:
        manifest["tables"][table] = write_table(fs, base, table, job.table_records(src, table, rows))
    for name in stats:
        if not (src / name).is_file():
            raise FileNotFoundError(f"{src / name} is missing; compute it with `raytpu data stats {job.name}`")
        _write_bytes(fs, f"{base}/{name}", (src / name).read_bytes())
    _write_bytes(fs, f"{base}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    fs.delete_file(f"{base}/{PARTIAL}")
    return manifest


def source_fingerprint(job: Job, src: Path, rows: int) -> str:
    """Hash of the format, job, options and every source file's name, size and mtime."""
    digest = hashlib.sha256(f"{FORMAT}|{job.name}|{rows}\n".encode())
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(src).as_posix()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _claim(fs: pafs.FileSystem, base: str, out: str) -> None:
    """Empty ``base`` for a fresh write: only a folder that is empty or raytpu's own
    (a manifest or the partial marker) is touched; the manifest goes first."""
    info = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    names = {Path(entry.path).name for entry in info}
    if names and not names & {MANIFEST, PARTIAL}:
        raise ValueError(f"--out {out!r} is not empty and was not written by `raytpu data prepare`; pick a new folder")
    if MANIFEST in names:
        fs.delete_file(f"{base}/{MANIFEST}")
    if names:
        fs.delete_dir_contents(base)
    fs.create_dir(base, recursive=True)
    _write_bytes(fs, f"{base}/{PARTIAL}", b"raytpu data prepare is writing this folder\n")


def write_table(fs: pafs.FileSystem, base: str, table: str, chunks: Iterable[Columns]) -> dict[str, Any]:
    """One parquet file per chunk; returns the table's manifest entry."""
    fs.create_dir(f"{base}/{table}", recursive=True)
    files: list[str] = []
    rows = nbytes = 0
    shapes: dict[str, list[int]] = {}
    schema: dict[str, str] = {}
    for index, columns in enumerate(chunks):
        arrow, shapes = to_arrow(columns)
        name = f"{table}/part-{index:05d}.parquet"
        pq.write_table(arrow, f"{base}/{name}", filesystem=fs)
        files.append(name)
        rows += arrow.num_rows
        nbytes += arrow.nbytes
        schema = {field.name: str(field.type) for field in arrow.schema}
    return {"rows": rows, "bytes": nbytes, "files": files, "shapes": shapes, "schema": schema}


def to_arrow(columns: Columns) -> tuple[pa.Table, dict[str, list[int]]]:
    """Columns -> an arrow table: (n, *shape) arrays become fixed-size lists of the
    flattened values (the shapes come back separately), the rest plain arrow arrays."""
    arrays: dict[str, pa.Array] = {}
    shapes: dict[str, list[int]] = {}
    for key, value in columns.items():
        if isinstance(value, np.ndarray) and value.ndim > 1:
            shapes[key] = list(value.shape[1:])
            flat = np.ascontiguousarray(value).reshape(len(value), -1)
            arrays[key] = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])
        else:
            arrays[key] = pa.array(value)
    return pa.table(arrays), shapes


def to_columns(table: pa.Table, shapes: dict[str, list[int]]) -> Columns:
    """The inverse of :func:`to_arrow` for a batch: numpy arrays, lists of bytes/str."""
    columns: Columns = {}
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        if name in shapes:
            values = column.flatten().to_numpy(zero_copy_only=False, writable=True)
            columns[name] = values.reshape(len(column), *shapes[name])
        elif pa.types.is_binary(column.type) or pa.types.is_string(column.type):
            columns[name] = column.to_pylist()
        else:
            columns[name] = column.to_numpy(zero_copy_only=False, writable=True)
    return columns


# ---------------------------------------------------------------- reading
@dataclass
class Prepared:
    """A complete prepared folder: its filesystem, path and manifest."""

    location: str
    fs: pafs.FileSystem
    base: str
    manifest: dict[str, Any]

    def table(self, name: str) -> dict[str, Any]:
        tables = self.manifest["tables"]
        if name not in tables:
            raise ConfigError(
                f"{self.location!r} has no prepared table {name!r} (it has {', '.join(tables)}); "
                f"prepare it from a source that holds it"
            )
        return tables[name]

    def paths(self, name: str) -> list[str]:
        return [f"{self.base}/{file}" for file in self.table(name)["files"]]

    def table_bytes(self, name: str) -> int:
        """The table's size in memory (arrow bytes; the files' sizes for a manifest without it)."""
        info = self.table(name)
        if "bytes" in info:
            return int(info["bytes"])
        return sum(entry.size or 0 for entry in self.fs.get_file_info(self.paths(name)))

    def stats_root(self) -> Path:
        """A local folder holding the stats files (downloaded when remote, into a folder deleted with
        this object or as the process exits: a worker left one in /tmp for every run before)."""
        if isinstance(self.fs, pafs.LocalFileSystem):
            return Path(self.base)
        folder = Path(tempfile.mkdtemp(prefix="raytpu-stats-"))
        weakref.finalize(self, shutil.rmtree, folder, True)
        for name in self.manifest.get("stats", []):
            with self.fs.open_input_stream(f"{self.base}/{name}") as stream, open(folder / name, "wb") as out:
                shutil.copyfileobj(stream, out)
        return folder


def open_prepared(location: str, job: str) -> Prepared:
    """The prepared folder at ``location``, or a one-line error that says how to make it."""
    if not location:
        raise ConfigError(f"data.loader=ray needs data.path: a folder made by `raytpu data prepare {job}`")
    fs, base = open_fs(location)
    manifest = _read_json(fs, f"{base}/{MANIFEST}")
    if manifest is None:
        state = "is only half-written" if _exists(fs, f"{base}/{PARTIAL}") else "holds no prepared parquet tables"
        raise ConfigError(
            f"data.loader=ray: data.path {location!r} {state}; run "
            f"`raytpu data prepare {job} --src <the {job} data folder> --out {location}`"
        )
    if manifest.get("job") != job or manifest.get("format") != FORMAT:
        raise ConfigError(
            f"data.path {location!r} was prepared for job {manifest.get('job')!r} ({manifest.get('format')}), "
            f"not {job!r} ({FORMAT}); prepare it again with `raytpu data prepare {job}`"
        )
    return Prepared(location, fs, base, manifest)


@dataclass
class EvalBatches:
    """Re-iterable eval batches: this worker's rows (``id % world == rank``) in batches of ``batch``."""

    iterator: Any
    decode: BatchDecoder
    shapes: dict[str, list[int]]
    rank: int
    world: int
    batch: int
    prefetch: int

    def __iter__(self) -> Iterator[Batch]:
        pending: pa.Table | None = None
        for table in self.iterator.iter_batches(batch_format="pyarrow", prefetch_batches=self.prefetch):
            ids = table.column("id").to_numpy()
            mine = table.filter(pa.array(ids % self.world == self.rank))
            pending = mine if pending is None else pa.concat_tables([pending, mine])
            while pending.num_rows >= self.batch:
                yield self.decode(to_columns(pending.slice(0, self.batch), self.shapes), 0)
                pending = pending.slice(self.batch)
        if pending is not None and pending.num_rows:
            yield self.decode(to_columns(pending, self.shapes), 0)
