"""Shared fixtures: a real S3 server (moto in server mode, reached through s3fs), job configs and their YAML
files, input files, a tiny model folder; and the suite's layers as markers:

  pytest -m engine            the decoding engine alone (seconds)
  pytest -m "not e2e and not cluster"   everything without Ray jobs
"""

from __future__ import annotations

import io
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch
import yaml
from moto.server import ThreadedMotoServer

from tests.tiny_models import save_model_dir, tiny_llama, tiny_tokenizer
from workers.config import JobConfig
from workers.storage import write_bytes_atomic

# Which test modules make up each layer of the suite (markers registered in pyproject.toml).
LAYERS = {
    "engine": ("test_generator", "test_cached_lm", "test_sampling", "test_controller"),
    "e2e": ("test_pipeline", "test_faults", "test_cli", "test_bench", "test_peers"),
    "cluster": ("test_cluster",),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        for marker, modules in LAYERS.items():
            if module in modules:
                item.add_marker(marker)


AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


class MotoS3:
    """A moto S3 server on 127.0.0.1 that can be stopped and started again on the same port."""

    def __init__(self) -> None:
        self.port = 0  # the first start picks a free port; restarts reuse it
        self._server: ThreadedMotoServer | None = None

    def start(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint_url, "key": "testing", "secret": "testing"}

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh random one by default) and return its s3:// URL."""
        name = name or f"test-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint_url).create_bucket(Bucket=name)
        return f"s3://{name}"


def _serving() -> Iterator[MotoS3]:
    server = MotoS3()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3() -> Iterator[MotoS3]:
    """One S3 server for the whole session, with fake AWS credentials in the environment."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log per request
    with pytest.MonkeyPatch.context() as mp:
        for key, value in AWS_ENV.items():
            mp.setenv(key, value)
        yield from _serving()


@pytest.fixture
def s3_bucket(s3: MotoS3) -> str:
    """A fresh, empty bucket on the session server, as s3://name."""
    return s3.make_bucket()


@pytest.fixture
def restartable_s3(s3: MotoS3) -> Iterator[MotoS3]:
    """A second server of its own, for tests that stop and restart it (moto's state survives restarts)."""
    yield from _serving()


@pytest.fixture
def job_config(tmp_path) -> Callable[..., JobConfig]:
    """Build a valid JobConfig around an input path; keyword sections are merged into the defaults."""

    def make(input_path: str, *, input: dict | None = None, output: dict | None = None, **sections: Any) -> JobConfig:
        return JobConfig.model_validate(
            {
                "input": {"path": input_path, **(input or {})},
                "output": {"path": str(tmp_path / "out"), **(output or {})},
                "model": {"target": "tiny-model"},
                **sections,
            }
        )

    return make


@pytest.fixture
def write_yaml(tmp_path) -> Callable[..., str]:
    """Write a config (a JobConfig or a plain dict) as a YAML file under tmp_path; return its path."""

    def write(config: JobConfig | dict, name: str = "job.yaml") -> str:
        data = config.model_dump(mode="json") if isinstance(config, JobConfig) else config
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return str(path)

    return write


@pytest.fixture
def write_input() -> Callable[..., str]:
    """Write rows (a list of dicts) as Parquet or JSONL, chosen by the URL's suffix; return the URL."""

    def write(
        url: str, rows: list[dict], storage_options: dict | None = None, row_group_size: int | None = None
    ) -> str:
        if url.endswith(".parquet"):
            buffer = io.BytesIO()
            pq.write_table(pa.Table.from_pylist(rows), buffer, row_group_size=row_group_size)
            data = buffer.getvalue()
        else:
            data = "".join(json.dumps(row) + "\n" for row in rows).encode()
        write_bytes_atomic(url, data, storage_options)
        return url

    return write


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for one test module (2 CPUs, bound to 127.0.0.1)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Llama and its tokenizer saved as a model folder, once per session."""
    tokenizer = tiny_tokenizer()
    return str(save_model_dir(tmp_path_factory.mktemp("tiny"), tiny_llama(len(tokenizer), dtype=torch.float32), tokenizer))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core machine spinning threads cost a lot."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
