"""Where runs and data live: a local folder, or a bucket (``gs://bucket/prefix``, ``s3://bucket/prefix``),
as one pyarrow filesystem and a path in it.

Credentials and endpoints are read as the clouds' own tools read them, on every node: for ``gs://``
Application Default Credentials (a TPU VM's service account, ``gcloud auth application-default
login``, ``GOOGLE_APPLICATION_CREDENTIALS``), or the emulator named by ``STORAGE_EMULATOR_HOST``;
for ``s3://`` the AWS credential chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``,
``~/.aws``, an instance role) and ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` for an
S3-compatible store. raytpu never reads a secret itself: only the endpoints (:data:`ENDPOINTS`)
travel to the workers. Every request has a time limit, so that a store that does not answer is an
error, never a wait.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pyarrow.fs as pafs

from raytpu.errors import ConfigError

SCHEMES = ("gs", "s3")
#: variables that say where a store is (never who may use it): what travels to the workers
ENDPOINTS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "STORAGE_EMULATOR_HOST")
#: URI query keys that would carry a secret into configs, logs and the job's runtime_env
SECRET_KEYS = ("access_key", "secret_key", "session_token")
#: seconds a request to a store may take (connecting, or waiting for an answer) before it is retried
REQUEST_TIMEOUT_S = 20.0


def is_remote(location: str) -> bool:
    """A bucket URI (``gs://``, ``s3://``), not a local folder."""
    return urlparse(str(location)).scheme in SCHEMES


def check_location(location: str, what: str) -> None:
    """A local path, ``file://``, ``gs://`` or ``s3://``, with no credentials in it."""
    parsed = urlparse(location)
    if "://" in location and parsed.scheme not in (*SCHEMES, "file"):
        raise ConfigError(f"{what}={location!r}: use a local folder, gs://bucket/prefix or s3://bucket/prefix")
    if parsed.scheme in SCHEMES and not parsed.netloc:
        raise ConfigError(f"{what}={location!r} names no bucket; write {parsed.scheme}://BUCKET/PREFIX")
    secrets = [key for key in parse_qs(parsed.query) if key in SECRET_KEYS]
    if secrets:
        raise ConfigError(
            f"{what} carries {', '.join(secrets)}: credentials never go into a path (it is saved in config.yaml "
            "and printed); use the AWS variables, ~/.aws/credentials or the node's role"
        )


def filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of ``location`` and the path in it (a local path made absolute)."""
    return cached_filesystem(str(location), tuple(sorted(endpoint_variables().items())))


@functools.lru_cache(maxsize=32)
def cached_filesystem(location: str, endpoints: tuple[tuple[str, str], ...]) -> tuple[pafs.FileSystem, str]:
    """One filesystem per location and endpoints (a client keeps its connections)."""
    parsed = urlparse(location)
    if parsed.scheme == "s3":
        return s3_filesystem(parse_qs(parsed.query)), f"{parsed.netloc}{parsed.path}".rstrip("/")
    if parsed.scheme == "gs":
        return gcs_filesystem(), f"{parsed.netloc}{parsed.path}".rstrip("/")
    if parsed.scheme == "file":
        return pafs.LocalFileSystem(), parsed.path
    return pafs.LocalFileSystem(), Path(location).resolve().as_posix()


def s3_filesystem(query: dict[str, list[str]]) -> pafs.S3FileSystem:
    """S3 with the endpoint of the URI (``?endpoint_override=HOST:PORT&scheme=http``), else
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``; credentials from the AWS chain."""
    endpoint = (query.get("endpoint_override") or [""])[0]
    scheme = (query.get("scheme") or ["https"])[0]
    url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    if not endpoint and url:
        endpoint_url = urlparse(url if "://" in url else f"https://{url}")
        endpoint, scheme = endpoint_url.netloc, endpoint_url.scheme
    region = (query.get("region") or [""])[0] or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    options: dict[str, Any] = {
        "connect_timeout": REQUEST_TIMEOUT_S,
        "request_timeout": REQUEST_TIMEOUT_S,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3),
    }
    if endpoint:
        options.update(endpoint_override=endpoint, scheme=scheme)
    return pafs.S3FileSystem(region=region or "us-east-1", **options)


def gcs_filesystem() -> pafs.FileSystem:
    """GCS with Application Default Credentials, or anonymously on ``STORAGE_EMULATOR_HOST``; every
    wait bounded (``retry_time_limit``). Wrapped so that removing a prefix works on GCS, which has
    no folders (:class:`GcsFolders`)."""
    limit = timedelta(seconds=REQUEST_TIMEOUT_S)
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator:
        url = urlparse(emulator if "://" in emulator else f"http://{emulator}")
        where = {"endpoint_override": url.netloc, "scheme": url.scheme}
        gcs = pafs.GcsFileSystem(anonymous=True, retry_time_limit=limit, **where)
    else:
        gcs = pafs.GcsFileSystem(retry_time_limit=limit)
    return pafs.PyFileSystem(GcsFolders(gcs))


class GcsFolders(pafs.FileSystemHandler):
    """A pyarrow filesystem as it is, except listing and deleting folders. GCS keeps no folders:
    a recursive listing names only objects (see :meth:`get_file_info_selector`), and pyarrow's
    ``delete_dir`` of a prefix written object by object (as Ray Train writes a checkpoint) deletes
    every object under it, then fails (404) on the folder marker that was never made (Ray Train's
    checkpoint retention would log that as an error at every deletion); ``delete_dir_contents``
    refuses such a prefix outright. Here both delete the objects under the prefix."""

    def __init__(self, inner: pafs.FileSystem) -> None:
        self.inner = inner

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GcsFolders) and self.inner.equals(other.inner)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __reduce__(self) -> tuple[Any, ...]:
        return (GcsFolders, (self.inner,))

    def get_type_name(self) -> str:
        return self.inner.type_name

    def normalize_path(self, path: str) -> str:
        return self.inner.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        """The listing, with the folders a recursive one implies: GCS lists objects only, and
        pyarrow's ``copy_files`` (Ray Train's checkpoint download too) makes local folders only for
        the folders the listing names."""
        found = self.inner.get_file_info(selector)
        if not selector.recursive:
            return found
        base = selector.base_dir.rstrip("/")
        named = {info.path.rstrip("/") for info in found}
        folders = {
            "/".join(parts[:depth])
            for parts in (info.path.split("/") for info in found if info.type == pafs.FileType.File)
            for depth in range(len(base.split("/")) + 1, len(parts))
        }
        return found + [pafs.FileInfo(path, pafs.FileType.Directory) for path in sorted(folders - named)]

    def create_dir(self, path: str, recursive: bool) -> None:
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.delete_dir_contents(path, missing_dir_ok=True)
        # the folder marker, if one was made; without one the prefix went with its last object
        with contextlib.suppress(OSError):
            self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        """Every object under ``path``, one by one (pyarrow's own refuses a prefix without a marker)."""
        selector = pafs.FileSelector(path, recursive=True, allow_not_found=missing_dir_ok)
        for info in self.inner.get_file_info(selector):
            if info.type == pafs.FileType.File:
                self.inner.delete_file(info.path)

    def delete_root_dir_contents(self) -> None:
        self.inner.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self.inner.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.inner.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.inner.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        return self.inner.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        return self.inner.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        return self.inner.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        return self.inner.open_append_stream(path, metadata=metadata)


def join(location: str, *parts: str) -> str:
    """``location`` with ``parts`` appended: a URI stays a URI, a local path a local path."""
    if is_remote(location) or location.startswith("file://"):
        base, query = location.split("?", 1) if "?" in location else (location, "")
        joined = "/".join([base.rstrip("/"), *(part.strip("/") for part in parts if part)])
        return f"{joined}?{query}" if query else joined  # the store's options stay at the end
    return str(Path(location, *parts))


def endpoint_variables() -> dict[str, str]:
    """The endpoint variables of this process (:data:`ENDPOINTS`), for the workers' environment."""
    return {name: os.environ[name] for name in ENDPOINTS if os.environ.get(name)}


# ------------------------------------------------------------------ the probe before a run
#: what a store's error says, lower case -> what is wrong and how to fix it ({bucket}, {scheme} filled in)
DIAGNOSES = (
    (("no_such_bucket", "bucket does not exist", "nosuchbucket"), "the bucket '{bucket}' does not exist: create it "
     "(gcloud storage buckets create gs://{bucket} / aws s3 mb s3://{bucket}) or fix the name"),
    (("access_denied", "accessdenied", "permission_denied", "forbidden", "403"),
     "the credentials may not write there: grant this node's account (a TPU VM's service account needs the "
     "storage read-write scope) write access to the bucket"),
    (("invalid_access_key_id", "invalidaccesskeyid", "signaturedoesnotmatch", "signature_does_not_match",
      "unauthenticated", "401", "credentials", "oauth2", "access token", "internal_failure"),
     "no valid credentials: for gs:// the VM's service account or `gcloud auth application-default login`, "
     "for s3:// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws/credentials"),
    (("network_connection", "could not connect", "could not resolve", "unavailable", "connection refused",
      "failed to connect", "timed out"),
     "the store does not answer: check AWS_ENDPOINT_URL(_S3) / STORAGE_EMULATOR_HOST and the network"),
    (("not_found", "not found", "404"), "the bucket '{bucket}' does not exist: create it "
     "(gcloud storage buckets create gs://{bucket} / aws s3 mb s3://{bucket}) or fix the name"),
)  # fmt: skip


#: the parts of a store's error that differ from one request to the next (object names, request ids,
#: times): read as words, a probe object named ``.raytpu-probe-…401`` was a credentials error
VOLATILE = re.compile(r"'[^']*'|\(request id: [^)]*\)|after \d+ ms")


def diagnose(location: str, message: str) -> str:
    """What a failed write to ``location`` means, in words that say what to do."""
    bucket = urlparse(location).netloc
    lowered = VOLATILE.sub("", message.lower())
    for words, text in DIAGNOSES:
        if any(mentions(lowered, word) for word in words):
            return text.format(bucket=bucket)
    return " ".join(message.split())[:200]


def mentions(message: str, word: str) -> bool:
    """``word`` in ``message``; a status code (``403``) only as a number of its own."""
    if word.isdigit():
        return re.search(rf"(?<![0-9a-z]){word}(?![0-9a-z])", message) is not None
    return word in message


def probe(location: str) -> None:
    """Write, read back and delete a small object under ``location`` (raises what the store says)."""
    import uuid

    fs, base = filesystem(location)
    path = f"{base}/.raytpu-probe-{uuid.uuid4().hex[:12]}"
    with fs.open_output_stream(path) as out:
        out.write(b"raytpu checks that it can write here\n")
    with fs.open_input_stream(path) as stream:
        stream.read()
    fs.delete_file(path)
