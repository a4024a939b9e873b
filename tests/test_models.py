"""Model references and the conversion cache."""
from __future__ import annotations

import os

import pytest

from workers.model_paths import check_model_path
from workers.models import gguf_cache_dir


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


def test_missing_models_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="gone"):
        check_model_path(str(tmp_path / "gone"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json|neither"):
        check_model_path(str(tmp_path / "folder"))
