"""A run's folder, local or in a bucket, read and written the same way by the driver and the workers.

Small files (``config.yaml``, the batch finder's record, Tune's ``results.csv``) are written in one
piece: atomically on a disk (a temporary file renamed), and an object store has no partial
objects. Files that grow while a run goes on (TensorBoard events, the logs of ``raytpu launch``'s
processes, a test's sample images) are written to a local staging folder and copied to the bucket
at known points (:meth:`RunFolder.sync`: after every evaluation, every log interval and at the end
of the run); in a local run folder they are written in place. Checkpoints are Ray Train's
(``raytpu.worker.reporting``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs

from raytpu.storage.filesystems import filesystem, is_remote, join

#: where a bucket run's growing files are staged on each node
STAGING = Path(tempfile.gettempdir()) / "raytpu-staging"


class RunFolder:
    """``location``: a local folder or a bucket prefix (``gs://bucket/runs/name``)."""

    def __init__(self, location: str | Path) -> None:
        self.location = str(location)
        self.remote = is_remote(self.location)
        self.fs, self.base = filesystem(self.location)
        self._synced: dict[Path, tuple[int, int]] = {}
        self._syncing = threading.Lock()  # one copy at a time: a later one never loses to an earlier one

    def __repr__(self) -> str:
        return f"RunFolder({self.location!r})"

    def uri(self, *parts: str) -> str:
        """The location of ``parts`` as a user names it (a URI in a bucket, a path on a disk)."""
        return join(self.location, *parts)

    def path(self, *parts: str) -> str:
        return "/".join([self.base, *parts]) if parts else self.base

    # ------------------------------------------------------------ small files
    def write_text(self, name: str, text: str) -> None:
        if not self.remote:
            target = Path(self.base, name)
            target.parent.mkdir(parents=True, exist_ok=True)
            handle, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            with os.fdopen(handle, "w") as out:
                out.write(text)
            os.replace(tmp, target)
            return
        with self.fs.open_output_stream(self.path(name)) as out:
            out.write(text.encode())

    def read_text(self, name: str) -> str | None:
        """The file's text, or None when there is none."""
        try:
            with self.fs.open_input_stream(self.path(name)) as stream:
                return stream.read().decode()
        except (FileNotFoundError, IsADirectoryError):
            return None
        except OSError as exc:
            if "NotFound" in str(exc) or "NO_SUCH" in str(exc) or "not found" in str(exc).lower():
                return None
            raise

    def exists(self, name: str = "") -> bool:
        return self.fs.get_file_info(self.path(name) if name else self.base).type != pafs.FileType.NotFound

    def children(self, name: str = "") -> list[str]:
        """The names directly under ``name`` (files and folders), sorted. A bucket is listed
        recursively: GCS shows a "folder" only through the objects under it."""
        root = self.path(name) if name else self.base
        selector = pafs.FileSelector(root, allow_not_found=True, recursive=self.remote)
        found = (info.path[len(root) :].strip("/").split("/")[0] for info in self.fs.get_file_info(selector))
        return sorted({child for child in found if child})

    def remove(self, name: str) -> None:
        """``name`` (a file or a folder) gone; nothing when there is none."""
        kind = self.fs.get_file_info(self.path(name)).type
        if kind == pafs.FileType.Directory:
            self.fs.delete_dir(self.path(name))
        elif kind == pafs.FileType.File:
            self.fs.delete_file(self.path(name))

    # ------------------------------------------------------------ growing files
    def local(self, name: str = "") -> Path:
        """The local folder where ``name`` is written: in place on a disk, staged for a bucket."""
        root = Path(self.base) if not self.remote else STAGING / hashlib.sha1(self.location.encode()).hexdigest()[:16]
        folder = root / name if name else root
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def sync(self, name: str = "") -> None:
        """Copy what changed of ``name`` (a staged file, or a staged folder's files) to the bucket;
        nothing to do on a disk. Each process syncs the files it writes: a copy of another
        process's growing file could overwrite a newer one."""
        if not self.remote:
            return
        root = self.local()
        staged = root / name if name else root
        files = [staged] if staged.is_file() else sorted(p for p in staged.rglob("*") if p.is_file())
        with self._syncing:
            self._copy_up(root, files)

    def _copy_up(self, root: Path, files: list[Path]) -> None:
        for path in files:
            stat = path.stat()
            if self._synced.get(path) == (stat.st_size, stat.st_mtime_ns):
                continue
            target = self.path(*path.relative_to(root).parts)
            with open(path, "rb") as source, self.fs.open_output_stream(target) as out:
                shutil.copyfileobj(source, out, 1 << 20)
            self._synced[path] = (stat.st_size, stat.st_mtime_ns)

    # ------------------------------------------------------------ reading back
    def fetch(self, name: str = "") -> Path:
        """A local copy of ``name`` (a file or a folder): itself on a disk, downloaded from a bucket."""
        if not self.remote:
            return Path(self.base, name) if name else Path(self.base)
        return download(self.fs, self.path(name) if name else self.base)


def download(fs: pafs.FileSystem, path: str) -> Path:
    """``path`` of ``fs`` (a file or a folder) into a new local temporary folder; its local path."""
    target = Path(tempfile.mkdtemp(prefix="raytpu-fetch-")) / Path(path).name
    if fs.get_file_info(path).type != pafs.FileType.File:
        target.mkdir()
    pafs.copy_files(path, str(target), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    return target


@contextlib.contextmanager
def local_copy(location: str) -> Iterator[Path]:
    """A file or folder named by a path or a bucket URI (``checkpoint.weights``), as a local path:
    itself, or a copy that is removed again on leaving the block."""
    if not is_remote(location):
        yield Path(location)
        return
    fs, path = filesystem(location)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        yield Path(location)  # a path that does not exist here: the caller says what it expected
        return
    copy = download(fs, path)
    try:
        yield copy
    finally:
        shutil.rmtree(copy.parent, ignore_errors=True)


def copy_folder(source: str, target: str) -> None:
    """Every file of the folder ``source`` into ``target``, each a path or a bucket URI (a PBT
    trial's copy of another trial's checkpoint, which that trial's retention may delete)."""
    source_fs, source_path = filesystem(source)
    target_fs, target_path = filesystem(target)
    target_fs.create_dir(target_path, recursive=True)
    pafs.copy_files(source_path, target_path, source_filesystem=source_fs, destination_filesystem=target_fs)
