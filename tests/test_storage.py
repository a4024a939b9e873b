"""Storage: atomic local writes, the same calls on a real S3 server, listing, and retries."""

from __future__ import annotations

import errno
import os
import threading

import aiohttp
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from workers.storage import (
    RetryPolicy,
    StorageError,
    exists,
    is_transient,
    join,
    list_files,
    on_storage,
    read_bytes,
    with_retries,
    write_bytes_atomic,
)

SUFFIXES = (".parquet", ".jsonl")


def client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def test_join_keeps_scheme_and_one_slash():
    assert join("s3://bucket/out/", "data", "/shard-00000.parquet") == "s3://bucket/out/data/shard-00000.parquet"
    assert join("/tmp/out", "summary.json") == "/tmp/out/summary.json"


def test_atomic_local_write_replaces_and_leaves_no_temp_files(tmp_path):
    target = tmp_path / "deep" / "folder" / "x.bin"
    write_bytes_atomic(str(target), b"first")
    write_bytes_atomic(f"file://{target}", b"second")
    assert target.read_bytes() == b"second"
    with pytest.raises(TypeError):
        write_bytes_atomic(str(target), "not bytes")  # type: ignore[arg-type]  # fails mid-write
    assert target.read_bytes() == b"second"
    assert os.listdir(target.parent) == ["x.bin"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # a normal file, not mkstemp's private one


def test_local_read_exists_and_listing(tmp_path):
    names = ["a.parquet", "sub/b.jsonl", "sub/deeper/c.PARQUET", "notes.txt", "_SUCCESS", ".a.tmp", "sub/.h.jsonl"]
    for name in names:
        write_bytes_atomic(str(tmp_path / name), name.encode())
    assert read_bytes(str(tmp_path / "sub/b.jsonl")) == b"sub/b.jsonl"
    assert exists(str(tmp_path / "sub")) and not exists(str(tmp_path / "nope"))
    everything = [str(tmp_path / n) for n in ["a.parquet", "sub/b.jsonl", "sub/deeper/c.PARQUET"]]
    assert list_files(str(tmp_path), suffixes=SUFFIXES) == everything
    assert list_files(str(tmp_path / "*.parquet"), suffixes=SUFFIXES) == everything[:1]
    assert list_files(str(tmp_path / "sub/b.jsonl"), suffixes=SUFFIXES) == everything[1:2]
    assert list_files(f"file://{tmp_path}/sub/", suffixes=SUFFIXES) == [f"file://{p}" for p in everything[1:]]
    assert list_files(str(tmp_path / "missing")) == []
    assert list_files(str(tmp_path)) == sorted([*everything, str(tmp_path / "notes.txt")])  # no hidden, no _SUCCESS


def test_s3_round_trip_and_listing(s3, s3_bucket):
    options = s3.storage_options
    for name in ["in/a.parquet", "in/sub/b.jsonl", "in/notes.txt", "in/_SUCCESS"]:
        write_bytes_atomic(join(s3_bucket, name), name.encode(), options)
    assert read_bytes(f"{s3_bucket}/in/sub/b.jsonl", options) == b"in/sub/b.jsonl"
    assert exists(f"{s3_bucket}/in/a.parquet", options) and not exists(f"{s3_bucket}/in/zzz", options)
    both = [f"{s3_bucket}/in/a.parquet", f"{s3_bucket}/in/sub/b.jsonl"]
    assert list_files(f"{s3_bucket}/in/", options, SUFFIXES) == both
    assert list_files(f"{s3_bucket}/in/*.parquet", options, SUFFIXES) == both[:1]
    assert list_files(f"{s3_bucket}/in/**/*.jsonl", options, SUFFIXES) == both[1:]
    assert list_files(f"{s3_bucket}/in/sub/b.jsonl", options, SUFFIXES) == both[1:]
    assert list_files(f"{s3_bucket}/nothing/", options, SUFFIXES) == []
    write_bytes_atomic(f"{s3_bucket}/in/c.parquet", b"late", options)  # a listing sees later writes
    assert len(list_files(f"{s3_bucket}/in/", options, SUFFIXES)) == 3


def test_retries_a_flaky_call_then_succeeds():
    calls, sleeps = [], []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
        return "ok"

    assert with_retries(flaky, "s3://bucket/key", sleep=sleeps.append) == "ok"
    assert len(calls) == 3 and len(sleeps) == 2 and sleeps[0] <= 0.2 and sleeps[1] <= 0.4


def test_gives_up_with_storage_error_naming_the_path_not_the_secret():
    sleeps: list[float] = []

    def down() -> None:
        raise client_error(503, "SlowDown")

    with pytest.raises(StorageError) as info:
        with_retries(down, "s3://AKIAKEY:s3cr3t@bucket/key", "read", RetryPolicy(7, 0.2, 1), sleeps.append)
    message = str(info.value)
    assert "could not read s3://***@bucket/key after 7 attempts" in message and "SlowDown" in message
    assert "s3cr3t" not in message and "AKIAKEY" not in message
    assert len(sleeps) == 6 and max(sleeps) <= 1


def test_definite_errors_are_not_retried():
    calls = []

    def missing() -> None:
        calls.append(1)
        raise FileNotFoundError("s3://bucket/missing")

    with pytest.raises(FileNotFoundError):
        with_retries(missing, "s3://bucket/missing", sleep=lambda s: None)
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (ConnectionResetError(), True),
        (OSError(errno.ECONNREFUSED, "refused"), True),
        (TimeoutError(), True),
        (EndpointConnectionError(endpoint_url="http://x"), True),
        (aiohttp.ServerDisconnectedError(), True),
        (client_error(500, "InternalError"), True),
        (client_error(400, "Throttling"), True),
        (client_error(429, "TooManyRequests"), True),
        (client_error(404, "NoSuchKey"), False),
        (client_error(403, "AccessDenied"), False),
        (PermissionError("denied"), False),
        (FileNotFoundError(), False),
        (ValueError("bad"), False),
    ],
)
def test_transient_classification(exc, transient):
    assert is_transient(exc) is transient


def test_transient_cause_is_found_behind_a_translated_error():
    translated = OSError(errno.EIO, "We encountered an internal error")  # what s3fs raises for a 500
    translated.__cause__ = client_error(500, "InternalError")
    assert is_transient(translated)


def test_stopped_server_gives_storage_error_naming_path(restartable_s3):
    bucket = restartable_s3.make_bucket()
    # no retries inside botocore, so that only our policy decides how long this takes
    options = {**restartable_s3.storage_options, "config_kwargs": {"retries": {"max_attempts": 1}}}
    write_bytes_atomic(f"{bucket}/x", b"x", options)
    restartable_s3.stop()
    with pytest.raises(StorageError, match=f"could not read {bucket}/x after 2 attempts") as info:
        on_storage(f"{bucket}/x", options, lambda fs, path: fs.cat_file(path), "read", RetryPolicy(2, 0.01, 0.01))
    assert "testing" not in str(info.value)


def test_reconnects_after_the_server_restarts(restartable_s3):
    bucket = restartable_s3.make_bucket()
    options = restartable_s3.storage_options
    write_bytes_atomic(f"{bucket}/x", b"before", options)
    restartable_s3.stop()
    restart = threading.Timer(0.5, restartable_s3.start)
    restart.start()
    try:
        assert read_bytes(f"{bucket}/x", options) == b"before"  # retried until the server is back
        write_bytes_atomic(f"{bucket}/x", b"after", options)
        assert read_bytes(f"{bucket}/x", options) == b"after"
    finally:
        restart.join()
