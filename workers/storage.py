"""Object storage through fsspec: one code path for plain paths, file:// and s3:// (s3fs).

Workers and the driver both read and write storage, so this lives in workers/. Every call retries
transient failures (connection refused or reset, timeouts, 5xx, throttling) with exponential
backoff and then raises StorageError naming the path. storage_options carry credentials, so they
are never logged and never put in a message; URLs are shown through safe_url.
"""

from __future__ import annotations

import errno
import glob
import json
import logging
import os
import random
import re
import time
import sys
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)

T = TypeVar("T")

_USERINFO = re.compile(r"([A-Za-z][\w+.-]*://)[^/@\s]+@")
_TRANSIENT_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.EPIPE,
}
_THROTTLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "RequestTimeout",
    "ServiceUnavailable",
    "InternalError",
}
# Errors that say something definite about the path: retrying cannot help.
_DEFINITE = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)


class StorageError(RuntimeError):
    """Storage stayed unreachable after every retry; the message names the path, never credentials."""


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to retry: `attempts` tries, waits of base_s * 2**n (jittered) capped at cap_s."""

    attempts: int = 5
    base_s: float = 0.2
    cap_s: float = 5.0

    def delay(self, failures: int) -> float:
        """Seconds to wait after the n-th failure; jitter keeps many workers from retrying in step."""
        return min(self.cap_s, self.base_s * 2**failures) * random.uniform(0.5, 1.0)


DEFAULT_RETRY = RetryPolicy()


def safe_url(text: str) -> str:
    """Text with user:password@ removed from any URL in it, so that it can be shown."""
    return _USERINFO.sub(r"\1***@", text)


def is_remote(url: str) -> bool:
    """Whether a URL names object storage or another remote filesystem (s3://, gs://, ...), not a local path."""
    return "://" in url and not url.startswith("file://")


def absolute(path: str) -> str:
    """A local path made absolute (against the working directory, ~ expanded) so that every printed path can be
    used from anywhere; URLs (s3://, file://) unchanged."""
    if "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem and in-filesystem path for a URL (instances are cached by fsspec)."""
    return url_to_fs(url, **(storage_options or {}))


def join(url: str, *parts: str) -> str:
    """url/part1/part2 with exactly one slash between pieces, keeping the scheme."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def is_transient(exc: BaseException) -> bool:
    """Whether an error (or what caused it) is one that a retry may cure."""
    if isinstance(exc, _DEFINITE):
        return False
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _transient_here(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def _transient_here(exc: BaseException) -> bool:
    """aiohttp and botocore are read only where s3fs has imported them: an error of theirs cannot exist otherwise,
    and importing them costs every driver and worker about 0.3 s of start-up on local files."""
    botocore, aiohttp = sys.modules.get("botocore.exceptions"), sys.modules.get("aiohttp")
    if botocore is not None:
        if isinstance(exc, botocore.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return status >= 500 or status == 429 or exc.response.get("Error", {}).get("Code") in _THROTTLE_CODES
        if isinstance(exc, (botocore.ConnectionError, botocore.HTTPClientError)):
            return True
    if aiohttp is not None:
        if isinstance(exc, aiohttp.ClientResponseError):
            return exc.status >= 500 or exc.status == 429
        if isinstance(exc, aiohttp.ClientError):
            return True
    return isinstance(exc, (ConnectionError, TimeoutError)) or (isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS)


def _describe(exc: BaseException) -> str:
    return safe_url(f"{type(exc).__name__}: {exc}")


def with_retries(
    fn: Callable[[], T],
    path: str,
    what: str = "access",
    policy: RetryPolicy = DEFAULT_RETRY,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """fn(), retried on transient errors; other errors pass through unchanged.

    After policy.attempts transient failures, raises StorageError("could not WHAT PATH ...").
    """
    failures = 0
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below, re-raised when not transient
            if not is_transient(exc):
                raise
            failures += 1
            if failures >= policy.attempts:
                raise StorageError(
                    f"could not {what} {safe_url(path)} after {failures} attempts: {_describe(exc)}"
                ) from exc
            wait = policy.delay(failures - 1)
            log.warning("%s %s failed (%s); retry in %.1fs", what, safe_url(path), _describe(exc), wait)
            sleep(wait)


def on_storage(
    url: str,
    storage_options: dict[str, Any] | None,
    fn: Callable[[AbstractFileSystem, str], T],
    what: str = "access",
    policy: RetryPolicy = DEFAULT_RETRY,
) -> T:
    """fn(fs, path) for the URL, with retries.

    A transient failure drops fsspec's cached instances of that filesystem class, so that the next
    attempt connects afresh (to a server that may have restarted) instead of reusing a dead client.
    """

    def attempt() -> T:
        fs, path = filesystem(url, storage_options)
        try:
            return fn(fs, path)
        except Exception as exc:
            if is_transient(exc):
                type(fs).clear_instance_cache()
            raise

    return with_retries(attempt, url, what, policy)


def read_bytes(url: str, storage_options: dict[str, Any] | None = None) -> bytes:
    """The whole object or file."""
    return on_storage(url, storage_options, lambda fs, path: fs.cat_file(path), "read")


def exists(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether a file or folder exists at the URL."""
    def check(fs: AbstractFileSystem, path: str) -> bool:
        fs.invalidate_cache(path)  # another process may have written it since we last listed
        return fs.exists(path)

    return on_storage(url, storage_options, check, "check")


def write_bytes_atomic(url: str, data: bytes, storage_options: dict[str, Any] | None = None) -> None:
    """Write data so that readers see the old state or all of it, never a part.

    Local: a temporary file in the same folder, then os.replace. Object stores: one PUT (or a
    completed multipart upload for huge data), which is atomic by nature.
    """

    def write(fs: AbstractFileSystem, path: str) -> None:
        if isinstance(fs, LocalFileSystem):
            _replace_local(path, data)
        else:
            fs.pipe_file(path, data)

    on_storage(url, storage_options, write, "write")


def _replace_local(path: str, data: bytes) -> None:
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.tmp")  # hidden: listings skip it
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def list_files(
    url: str, storage_options: dict[str, Any] | None = None, suffixes: Iterable[str] | None = None
) -> list[str]:
    """Sorted URLs of the files at a file, a folder (recursively) or a glob.

    Keeps the URL's scheme (s3://bucket/key); hidden and underscore files (._tmp, _SUCCESS) are
    skipped, and with suffixes only names ending in one of them (case-insensitive) are kept.
    A path that does not exist lists nothing.
    """
    wanted = tuple(s.lower() for s in suffixes) if suffixes is not None else None

    def find(fs: AbstractFileSystem, path: str) -> list[str]:
        fs.invalidate_cache()  # listings cached by an earlier call may predate other writers
        if glob.has_magic(path):
            found = fs.glob(path, detail=True)
        elif fs.isdir(path):
            found = fs.find(path, detail=True)
        elif fs.isfile(path):
            found = {path: {"type": "file"}}
        else:
            found = {}
        paths = [p for p, info in found.items() if info["type"] == "file" and _listed(p, wanted)]
        return sorted(fs.unstrip_protocol(p) if "://" in url else p for p in paths)

    return on_storage(url, storage_options, find, "list")


def _listed(path: str, suffixes: tuple[str, ...] | None) -> bool:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return not name.startswith((".", "_")) and (suffixes is None or name.lower().endswith(suffixes))


@dataclass
class Store:
    """A folder in storage with its options bound once (a job's output folder); files are named by parts."""

    root: str
    options: dict[str, Any] = field(default_factory=dict)

    def url(self, *parts: str) -> str:
        return join(self.root, *parts)

    def read(self, *parts: str) -> bytes:
        return read_bytes(self.url(*parts), self.options)

    def write(self, data: bytes, *parts: str) -> None:
        write_bytes_atomic(self.url(*parts), data, self.options)

    def exists(self, *parts: str) -> bool:
        return exists(self.url(*parts), self.options)

    def list(self, *parts: str, suffixes: Iterable[str] | None = None) -> list[str]:
        return list_files(self.url(*parts), self.options, suffixes)

    def read_json(self, *parts: str) -> Any:
        """The parsed JSON file, or None when there is none."""
        return json.loads(self.read(*parts)) if self.exists(*parts) else None

    def write_json(self, data: Any, *parts: str) -> None:
        self.write(json.dumps(data, indent=2, default=str).encode(), *parts)

    def delete(self, *parts: str) -> None:
        """Remove a file or a folder (recursively); nothing to do when it is absent."""
        if self.exists(*parts):
            self.apply(lambda fs, path: fs.rm(path, recursive=True), "delete", *parts)

    def apply(self, fn: Callable[[AbstractFileSystem, str], T], what: str, *parts: str) -> T:
        """fn(fs, path) for a file or folder of the store, with retries (see on_storage)."""
        return on_storage(self.url(*parts), self.options, fn, what)

