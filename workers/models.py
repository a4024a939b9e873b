"""Model loading: local folders, object-storage folders and GGUF files, always ending in safetensors.

Workers load each model once, and load Llama-family checkpoints without transformers (engine/checkpoint.py):
its modeling code takes longer to import than the demo model takes to load. GGUF files (like the bundled
SmolLM2 demo model) are dequantized once and cached as safetensors, because transformers' GGUF path takes
tens of seconds per load; folders in object storage are copied once per node into the same cache, keyed by
path, size and etag. GGUF conversions are keyed by the file's content, so clones and virtualenvs share them.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

from typing import TYPE_CHECKING

import torch

from workers.engine.checkpoint import CheckpointLM, read_config, readable
from workers.model_paths import DEMO_MODEL, cache_root, demo_model_gguf
from workers.storage import filesystem, is_remote
from workers.tokenizer import Tokenizer, read_settings

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cpu_has(feature: str) -> bool:
    check = getattr(torch.cpu, f"_is_{feature}_supported", None)
    return bool(check and check())


def native_dtypes(device: torch.device) -> set[torch.dtype]:
    """The dtypes `device` multiplies in natively. CPUs: bf16 with AVX512-BF16 or AMX (this repo's CPU runs
    a SmolLM2 pass ~1.25x faster at width 1 and ~1.6x at width 9 in bf16), fp16 with AMX-FP16; without
    those, half precision is emulated and slower than fp32."""
    if device.type == "cuda":
        return {torch.float32, torch.float16} | ({torch.bfloat16} if torch.cuda.is_bf16_supported() else set())
    if device.type == "cpu":
        bf16 = _cpu_has("avx512_bf16") or _cpu_has("amx_tile")
        return {torch.float32} | ({torch.bfloat16} if bf16 else set()) | ({torch.float16} if _cpu_has("amx_fp16") else set())
    return {torch.float32}


def resolve_dtype(name: str, device: torch.device, checkpoint: torch.dtype | None) -> torch.dtype:
    """`auto` is the checkpoint's dtype, as in transformers, where `device` runs it natively; fp32 otherwise
    (and for a checkpoint that does not say)."""
    if name != "auto":
        return _DTYPES[name]
    return checkpoint if checkpoint in native_dtypes(device) else torch.float32


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def gguf_cache_dir(gguf: Path) -> Path:
    """Where a GGUF file's conversion lives, keyed by the file's content: every checkout, venv or copy of
    the same file shares one conversion, and a changed file gets a new one."""
    stat = gguf.stat()
    return cache_root() / "models" / f"{gguf.stem}-{_key(stat.st_size, _content_digest(str(gguf), stat.st_size, stat.st_mtime_ns))}"


@functools.lru_cache(maxsize=8)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file, read once per machine while the file is unchanged: the digest is kept in the cache under
    the file's path, size and modification time (hashing the 98 MB demo model took 0.06-0.1 s of every worker's
    start). A changed file has a new modification time, so it is read again."""
    memo = cache_root() / "digests" / _key(os.path.realpath(path), size, mtime_ns)
    try:
        known = memo.read_text()
        if len(known) == 64:
            return known
    except OSError:
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(digest.hexdigest())
        tmp.replace(memo)  # whole or absent: workers of one node may race
    except OSError:
        pass  # a read-only cache: hash again next time
    return digest.hexdigest()


def _convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors folder (model and tokenizer) and return it."""
    out = gguf_cache_dir(gguf)
    if (out / "_COMPLETE").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # the weights are dequantized fp32 now; saving them is lossless
    model.config.__dict__.pop("quantization_config", None)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    return _publish(tmp, out)


def _publish(tmp: Path, out: Path) -> Path:
    """Move a finished cache folder into place; several workers on one node may race, the first one wins."""
    _plain_modes(tmp)
    (tmp / "_COMPLETE").touch()
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "_COMPLETE").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _plain_modes(folder: Path) -> None:
    """Give a cache folder the modes plain files get under the user's umask (0644/0755, or 0640/0750 under 027),
    like the rest of ~/.cache: transformers writes model.safetensors through a temporary file, which is 0600,
    so the group could read every file of the cache but the weights."""
    umask = os.umask(0o022)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _download_folder(url: str, storage_options: dict) -> Path:
    """Copy a model folder from object storage once per node; the cache key covers every file's etag and size."""
    fs, root = filesystem(url, storage_options)
    files = {p: info for p, info in fs.find(root, detail=True).items() if info.get("type") != "directory"}
    if not files:
        raise FileNotFoundError(f"model path {url} holds no files")
    fingerprint = sorted((p, info.get("size"), info.get("ETag") or info.get("etag")) for p, info in files.items())
    out = cache_root() / "models" / f"{Path(root.rstrip('/')).name}-{_key(url, fingerprint)}"
    if (out / "_COMPLETE").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    for path in files:
        local = tmp / os.path.relpath(path, root.rstrip("/"))
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(local))
    return _publish(tmp, out)


def local_model_dir(path: str, storage_options: dict | None = None) -> Path:
    """Turn any supported model reference into a local folder of safetensors weights and a tokenizer."""
    if path == DEMO_MODEL:
        return _convert_gguf(demo_model_gguf())
    if is_remote(path):
        folder = _download_folder(path, storage_options or {})
        ggufs = sorted(folder.glob("*.gguf"))
        return _convert_gguf(ggufs[0]) if ggufs else folder
    local = Path(path.removeprefix("file://")).expanduser()
    if local.suffix == ".gguf":
        if not local.is_file():
            raise FileNotFoundError(f"model file {path} does not exist")
        return _convert_gguf(local)
    if not (local / "config.json").is_file():
        raise FileNotFoundError(f"model path {path} is not a model folder (no config.json)")
    return local


def load_model(path: str, dtype: str, device: torch.device, storage_options: dict | None = None,
               trust_remote_code: bool = False, transformers_model: bool = True) -> PreTrainedModel | CheckpointLM:
    """Load safetensors weights only (never pickle) in eval mode on `device`. Without `transformers_model`
    (callers that run the model through the fused decoder only), a checkpoint engine/checkpoint.py reads
    loads as a CheckpointLM: the same weights, without transformers' modules."""
    folder = local_model_dir(path, storage_options)
    raw = read_config(folder)
    dtype = resolve_dtype(dtype, device, _DTYPES.get(raw.get("dtype") or raw.get("torch_dtype")))
    if not transformers_model and readable(folder, trust_remote_code):
        return CheckpointLM.load(folder, dtype, device)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def load_tokenizer(path: str, storage_options: dict | None = None, trust_remote_code: bool = False,
                   transformers_tokenizer: bool = True) -> PreTrainedTokenizerBase | Tokenizer:
    """The tokenizer AutoTokenizer gives. Without `transformers_tokenizer` (workers), one transformers would
    build unchanged from its tokenizer.json loads without transformers (workers/tokenizer.py). A folder whose
    tokenizer_config.json names transformers' own tokenizers-backed class loads that class directly:
    AutoTokenizer would first import the model's whole configuration machinery (~2 s of a worker's start-up)."""
    folder = local_model_dir(path, storage_options)
    if not transformers_tokenizer and not trust_remote_code and (tokenizer := Tokenizer.load(folder)) is not None:
        return tokenizer
    config = read_settings(folder)
    if config.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in config and not trust_remote_code:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
