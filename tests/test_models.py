"""Model references and the conversion cache."""
from __future__ import annotations

import os

import pytest
import torch

from tests.tiny_models import save_model_dir, tiny_llama, tiny_tokenizer
from workers.model_paths import check_model_path
from workers.models import _content_digest, _publish, gguf_cache_dir


def test_gguf_cache_is_keyed_by_content_not_path_or_mtime(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    a, b, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, content in ((a, b"GGUF same bytes"), (b, b"GGUF same bytes"), (other, b"GGUF other bytes")):
        path.parent.mkdir()
        path.write_bytes(content)
    os.utime(b, (1, 1))  # another checkout: another folder, another mtime
    assert gguf_cache_dir(a) == gguf_cache_dir(b)
    assert gguf_cache_dir(a) != gguf_cache_dir(other)
    assert gguf_cache_dir(a).parent == tmp_path / "cache" / "models" and gguf_cache_dir(a).name.startswith("m-")


def test_a_files_digest_is_read_once_per_machine_until_the_file_changes(tmp_path, monkeypatch):
    """The digest is remembered across processes (the in-process cache is cleared here to stand for a new
    worker), and a rewritten file is hashed again."""
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF first bytes")
    first = gguf_cache_dir(model)
    opened = []
    monkeypatch.setattr("builtins.open", lambda *a, **k: opened.append(a[0]) or open_(*a, **k))
    _content_digest.cache_clear()
    assert gguf_cache_dir(model) == first and str(model) not in map(str, opened)
    model.write_bytes(b"GGUF other bytes")
    os.utime(model, ns=(1, 1))
    _content_digest.cache_clear()
    assert gguf_cache_dir(model) != first and str(model) in map(str, opened)


open_ = open


def test_missing_models_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="gone"):
        check_model_path(str(tmp_path / "gone"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json|neither"):
        check_model_path(str(tmp_path / "folder"))


def test_cached_models_get_the_modes_of_plain_files(tmp_path):
    """save_pretrained writes the weights through a 0600 temporary file; the cache follows the umask instead."""
    tokenizer = tiny_tokenizer()
    tmp = save_model_dir(tmp_path / "m.tmp1", tiny_llama(len(tokenizer), dtype=torch.float32), tokenizer)
    old = os.umask(0o027)
    try:
        out = _publish(tmp, tmp_path / "m")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [out, *out.iterdir()]}
    assert modes.pop("m") == 0o750 and modes.pop("model.safetensors") == 0o640
    assert set(modes.values()) == {0o640}
