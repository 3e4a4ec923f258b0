"""A text corpus as users have it: files, folders and glob patterns of JSON lines, parquet, text or a
``datasets`` ``save_to_disk`` folder, on a local disk or in a bucket, found and read document by
document.

A corpus is a list of :class:`Unit` s, one per file: the unit a task reads, tokenizes and packs, the
unit of the seeded epoch order, and the place a resumed run starts reading again
(``raytpu.corpus.order``). Every file is read as a stream through the pyarrow filesystem that runs
use (``raytpu.storage.filesystems``), so a file is never held whole in memory (a ``.json`` array
file, which has no streaming form, excepted) and a bucket is read where the task runs.

Formats, by suffix (``.gz``, ``.bz2``, ``.zst`` and ``.lz4`` compressed ones too):

- ``.jsonl`` / ``.json``: JSON lines (a ``.json`` file may also be one array of objects); the text
  is the field ``data.text_column``.
- ``.parquet``: the column ``data.text_column``.
- ``.arrow``: Arrow IPC streams, as ``datasets``' ``save_to_disk`` writes them (a folder holding
  ``state.json``, or a ``DatasetDict`` folder holding ``dataset_dict.json`` and one folder per split).
- ``.txt``, ``.md``, ``.py``: each file is one document.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from raytpu.errors import ConfigError
from raytpu.storage.filesystems import diagnose, filesystem, is_remote

#: a suffix -> how its file is read
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
FORMATS.update({suffix: "text" for suffix in (".txt", ".md", ".py")})
COMPRESSIONS = (".gz", ".bz2", ".zst", ".lz4")
#: documents handed to the tokenizer at once, and the text they may hold before that
BATCH_DOCUMENTS = 512
BATCH_CHARACTERS = 1 << 20
#: a datasets save_to_disk folder's own files, and the split names read as validation
DATASET_INFO = ("state.json", "dataset_info.json")
DATASET_DICT = "dataset_dict.json"
VALIDATION_SPLITS = ("validation", "valid", "val")


class CorpusError(ConfigError):
    """A corpus that cannot be read as given: the message says which file and what to fix."""


@dataclass(frozen=True)
class Unit:
    """One file of a corpus: where it is (``root``: the location it was found under, as typed;
    ``path``: the file in that location's filesystem), how it is read, and its identity (its name
    under the root, size and modification time), which fingerprints the corpus."""

    root: str
    path: str
    format: str
    name: str
    size: int
    mtime_ns: int = 0

    def open(self) -> Any:
        """A readable stream of the file, decompressed when its suffix says so."""
        fs, _ = filesystem(self.root)
        return fs.open_input_stream(self.path, compression="detect")


def fingerprint(units: Sequence[Unit], *options: Any) -> str:
    """A short hash of the units' names, sizes and times and of ``options``: equal when nothing changed."""
    digest = hashlib.sha256(json.dumps([str(option) for option in options]).encode())
    for unit in units:
        digest.update(f"{unit.name}|{unit.size}|{unit.mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def format_of(name: str) -> str | None:
    stem = name
    for suffix in COMPRESSIONS:
        stem = stem.removesuffix(suffix)
    return FORMATS.get(PurePosixPath(stem).suffix.lower())


# ------------------------------------------------------------------ finding the files
def find_units(locations: Sequence[str], what: str) -> list[Unit]:
    """The files of ``locations`` (files, folders, glob patterns; local or bucket URIs), each found
    once, in the order given and, within a folder or pattern, by name."""
    units: dict[tuple[str, str], Unit] = {}
    for location in locations:
        for unit in units_of(location, what):
            units.setdefault((unit.root.partition("://")[0] if "://" in unit.root else "", unit.path), unit)
    return list(units.values())


def units_of(location: str, what: str) -> list[Unit]:
    pattern = any(char in location.split("?", 1)[0] for char in "*?[")
    base = glob_base(location) if pattern else location
    try:
        fs, path = filesystem(base)
        if pattern:
            inner = filesystem(location.split("?", 1)[0] if is_remote(location) else location)[1]
            found = [info for info in listing(fs, path) if fnmatch.fnmatchcase(info.path, inner)]
            return [unit_of(base, path, info, what) for info in found if format_of(info.path)]
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            return [unit_of(base, str(PurePosixPath(path).parent), info, what, named=True)]
        if info.type == pafs.FileType.Directory:
            return folder_units(base, fs, path, what)
    except OSError as exc:
        reason = diagnose(location, str(exc)) if is_remote(location) else " ".join(str(exc).split())[:300]
        raise CorpusError(f"{what} {location!r} cannot be read: {reason}") from None
    raise CorpusError(f"{what} {location!r} does not exist; give files, folders or glob patterns of the corpus")


def glob_base(location: str) -> str:
    """The folder a glob pattern searches: its longest leading part without a wildcard."""
    head, query = (location.split("?", 1) + [""])[:2] if is_remote(location) else (location, "")
    scheme, sep, rest = head.partition("://")
    parts = (rest if sep else head).split("/")
    fixed = []
    for part in parts:
        if any(char in part for char in "*?["):
            break
        fixed.append(part)
    base = "/".join(fixed) or "."
    base = f"{scheme}{sep}{base}" if sep else base
    return f"{base}?{query}" if query else base


def listing(fs: pafs.FileSystem, path: str) -> list[pafs.FileInfo]:
    """Every file under ``path``, by name, leaving out hidden ones (``.name``, ``_name``: markers)."""
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    visible = [
        info
        for info in infos
        if info.type == pafs.FileType.File
        and not any(part.startswith((".", "_")) for part in PurePosixPath(info.path).relative_to(path).parts)
    ]
    return sorted(visible, key=lambda info: info.path)


def folder_units(root: str, fs: pafs.FileSystem, path: str, what: str) -> list[Unit]:
    """A folder's files; a ``datasets`` folder's Arrow files (a ``DatasetDict``: its train split's)."""
    if exists(fs, f"{path}/{DATASET_DICT}"):
        return dataset_split_units(root, fs, path, "train", what)
    found = [info for info in listing(fs, path) if format_of(info.path)]
    if any(exists(fs, f"{path}/{name}") for name in DATASET_INFO):
        found = [info for info in found if info.path.endswith(".arrow")]
    if not found:
        kinds = ", ".join(sorted(set(FORMATS)))
        raise CorpusError(f"{what} {root!r} holds no corpus files ({kinds}, or a datasets save_to_disk folder)")
    return [unit_of(root, path, info, what) for info in found]


def dataset_split_units(root: str, fs: pafs.FileSystem, path: str, split: str, what: str) -> list[Unit]:
    """The Arrow files of one split of a ``DatasetDict`` folder."""
    with fs.open_input_stream(f"{path}/{DATASET_DICT}") as stream:
        splits = json.loads(stream.read()).get("splits", [])
    if split not in splits:
        raise CorpusError(f"{what} {root!r} is a datasets DatasetDict without a {split!r} split (it has {splits})")
    found = [info for info in listing(fs, f"{path}/{split}") if info.path.endswith(".arrow")]
    return [unit_of(root, path, info, what) for info in found]


def validation_split_of(location: str) -> list[Unit] | None:
    """A ``DatasetDict`` folder's validation split (``validation``, ``valid`` or ``val``), if it has one."""
    fs, path = filesystem(location)
    if not exists(fs, f"{path}/{DATASET_DICT}"):
        return None
    with fs.open_input_stream(f"{path}/{DATASET_DICT}") as stream:
        splits = json.loads(stream.read()).get("splits", [])
    split = next((name for name in VALIDATION_SPLITS if name in splits), None)
    return dataset_split_units(location, fs, path, split, "data.validation_files") if split else None


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.File


def unit_of(root: str, base: str, info: pafs.FileInfo, what: str, named: bool = False) -> Unit:
    kind = format_of(info.path)
    if kind is None:
        kinds = ", ".join(sorted(FORMATS))
        raise CorpusError(f"{what} {info.path!r}: not a corpus file; use {kinds} (optionally compressed)")
    name = PurePosixPath(info.path).name if named else str(PurePosixPath(info.path).relative_to(base))
    mtime = info.mtime_ns or 0
    return Unit(root, info.path, kind, name, int(info.size or 0), int(mtime))


# ------------------------------------------------------------------ reading the documents
def documents(unit: Unit, text_column: str) -> Iterator[list[str]]:
    """The unit's documents, in file order, a batch (:data:`BATCH_DOCUMENTS`) at a time; a file
    that is not what its suffix says, or lacks the text column, is a :class:`CorpusError`."""
    readers = {"json": json_documents, "parquet": parquet_documents, "arrow": arrow_documents}
    with read_errors(unit):
        if unit.format == "text":
            yield from text_documents(unit)
        else:
            yield from batched(readers[unit.format](unit, text_column))


@contextlib.contextmanager
def read_errors(unit: Unit) -> Iterator[None]:
    """A file that is not what its name says, as one :class:`CorpusError` naming it."""
    try:
        yield
    except (pa.ArrowInvalid, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorpusError(f"{unit.name}: {readable(unit.format)}: {' '.join(str(exc).split())[:200]}") from None
    except OSError as exc:  # a compressed file whose content is not what its suffix says
        if not unit.name.endswith(COMPRESSIONS):
            raise
        kind = PurePosixPath(unit.name).suffix.lstrip(".")
        reason = " ".join(str(exc).split())[:200]
        raise CorpusError(f"{unit.name}: not a {kind} file, as its suffix says ({reason}); fix or rename it") from None


def records(unit: Unit) -> Iterator[list[dict[str, Any]]]:
    """The unit's rows as mappings of their fields (conversations, prompts and completions), a batch
    at a time: JSON lines, parquet and Arrow files; a text file has no fields, and is refused."""
    with read_errors(unit):
        if unit.format == "json":
            with unit.open() as stream:
                head = stream.read(1 << 16)
            if head.lstrip()[:1] == b"[":  # one JSON array of objects (no streaming form)
                with unit.open() as stream:
                    yield json.loads(stream.read())
                return
            import pyarrow.json as pajson

            with unit.open() as stream:
                for batch in pajson.open_json(stream, read_options=pajson.ReadOptions(block_size=1 << 22)):
                    yield batch.to_pylist()
        elif unit.format == "parquet":
            import pyarrow.parquet as pq

            fs, _ = filesystem(unit.root)
            with fs.open_input_file(unit.path) as handle:
                for batch in pq.ParquetFile(handle).iter_batches(batch_size=BATCH_DOCUMENTS):
                    yield batch.to_pylist()
        elif unit.format == "arrow":
            with unit.open() as stream:
                for batch in pa.ipc.open_stream(stream):
                    yield batch.to_pylist()
        else:
            raise CorpusError(f"{unit.name}: a text file holds no rows of fields; give JSON lines, parquet or Arrow")


def readable(kind: str) -> str:
    return {
        "json": "not JSON lines (one JSON object per line, or one JSON array of objects)",
        "parquet": "not a parquet file",
        "arrow": "not an Arrow stream (a datasets save_to_disk file)",
        "text": "not UTF-8 text",
    }[kind]


def text_documents(unit: Unit) -> Iterator[list[str]]:
    """A text file is one document, read whole."""
    with unit.open() as stream:
        yield [stream.read().decode("utf-8", errors="replace")]


def json_documents(unit: Unit, column: str) -> Iterator[pa.Array]:
    import pyarrow.json as pajson

    with unit.open() as stream:
        head = stream.read(1 << 16)
        if head.lstrip()[:1] == b"[":  # one JSON array of objects (no streaming form)
            records = json.loads(head + stream.read())
            yield pa.array([record_text(record, column, unit) for record in records], pa.string())
            return
    with unit.open() as stream:
        reader = pajson.open_json(stream, read_options=pajson.ReadOptions(block_size=1 << 22))
        for batch in reader:
            yield text_of(batch, column, unit)


def record_text(record: Any, column: str, unit: Unit) -> str:
    if not isinstance(record, dict) or column not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise CorpusError(f"{unit.name}: no text field {column!r} (records have {keys}); set data.text_column")
    return str(record[column])


def parquet_documents(unit: Unit, column: str) -> Iterator[pa.Array]:
    import pyarrow.parquet as pq

    fs, _ = filesystem(unit.root)
    with fs.open_input_file(unit.path) as handle:
        parquet = pq.ParquetFile(handle)
        names = parquet.schema_arrow.names
        if column not in names:
            raise CorpusError(f"{unit.name}: no text column {column!r} (it has {names}); set data.text_column")
        for batch in parquet.iter_batches(batch_size=BATCH_DOCUMENTS, columns=[column]):
            yield text_of(batch, column, unit)


def arrow_documents(unit: Unit, column: str) -> Iterator[pa.Array]:
    with unit.open() as stream:
        for batch in pa.ipc.open_stream(stream):
            yield text_of(batch, column, unit)


def text_of(batch: pa.RecordBatch, column: str, unit: Unit) -> pa.Array:
    names = batch.schema.names
    if column not in names:
        raise CorpusError(f"{unit.name}: no text column {column!r} (it has {names}); set data.text_column")
    values = batch.column(names.index(column))
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        raise CorpusError(f"{unit.name}: column {column!r} holds {values.type}, not text; set data.text_column")
    return values


def batched(arrays: Iterator[pa.Array]) -> Iterator[list[str]]:
    """Arrow string arrays as lists of at most :data:`BATCH_DOCUMENTS` documents (nulls left out)."""
    pending: list[str] = []
    size = 0
    for array in arrays:
        for text in array.to_pylist():
            if text is None:
                continue
            pending.append(text)
            size += len(text)
            if len(pending) >= BATCH_DOCUMENTS or size >= BATCH_CHARACTERS:
                yield pending
                pending, size = [], 0
    if pending:
        yield pending
