"""Resolve a model or adapter name to a local directory: a local path, or a Hugging Face hub repo.

Hub repos are fetched with ``huggingface_hub.snapshot_download`` (only the files an engine needs)
and work offline from the local hub cache when ``HF_HUB_OFFLINE=1`` or the hub is unreachable.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError, HFValidationError

logger = logging.getLogger(__name__)

_META_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken"]  # configs, tokenizers, vocab
_WEIGHT_PATTERNS = [["*.safetensors"], ["*.bin"], ["*.pth"]]  # in order of preference
_ADAPTER_PATTERNS = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]


def _offline() -> bool:
    """Offline mode, read at call time (huggingface_hub reads its env vars once, at import)."""
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return env.upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE


def _weight_patterns(repo_id: str, revision: str | None, offline: bool) -> list[str]:
    """One weight format only, so a repo holding safetensors and .bin/.pth is not fetched twice."""
    everything = [p for patterns in _WEIGHT_PATTERNS for p in patterns]
    if offline:
        return everything
    try:
        files = huggingface_hub.HfApi().list_repo_files(repo_id, revision=revision)
    except Exception as e:  # any hub error: let snapshot_download decide (and fall back)
        logger.debug("Cannot list files of %s (%s); fetching all weight formats", repo_id, e)
        return everything
    for patterns in _WEIGHT_PATTERNS:
        if any(fnmatch.fnmatch(f, p) for f in files for p in patterns):
            return patterns
    return everything


def _resolve(
    name: str, revision: str | None, cache_dir: str | os.PathLike | None, kind: str, adapter: bool
) -> Path:
    local = Path(name).expanduser()
    if local.is_dir() or local.is_file():
        return local
    offline = _offline()
    cache_dir = cache_dir if cache_dir is not None else os.environ.get("HF_HUB_CACHE")
    try:
        if adapter:
            patterns = _ADAPTER_PATTERNS
        else:
            patterns = _META_PATTERNS + _weight_patterns(name, revision, offline)
        path = huggingface_hub.snapshot_download(
            repo_id=name,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=patterns,
            local_files_only=offline,
        )
    except (HFValidationError, HfHubHTTPError, OSError, ValueError) as e:
        where = "in the offline hub cache" if offline else "downloadable or in the hub cache"
        raise FileNotFoundError(
            f"{kind} {name!r} (revision {revision or 'main'}) is neither a local directory nor a "
            f"hub repo {where} ({type(e).__name__}: {e})"
        ) from e
    logger.info("Resolved %s %r to %s", kind.lower(), name, path)
    return Path(path)


def resolve_model_path(
    model: str, revision: str | None = None, cache_dir: str | os.PathLike | None = None
) -> Path:
    """Return the local directory of ``model``: itself if it exists locally, else a hub snapshot.

    A hub repo id is fetched with ``snapshot_download`` restricted to configs, tokenizer files and
    one weight format (safetensors, else ``.bin``, else ``.pth``); offline (``HF_HUB_OFFLINE=1``)
    or with no network, the cached snapshot is used. ``cache_dir`` defaults to ``$HF_HUB_CACHE``
    (read at call time) or huggingface_hub's default cache.

    Raises:
        FileNotFoundError: naming ``model``, when it is neither a local path nor a downloadable or
            cached hub repo (wraps huggingface_hub's not-found, validation and HTTP errors).
    """
    return _resolve(model, revision, cache_dir, "Model", adapter=False)


def resolve_adapter_path(
    path: str, revision: str | None = None, cache_dir: str | os.PathLike | None = None
) -> Path:
    """Like :func:`resolve_model_path` for a LoRA adapter (``adapter_config.json`` and
    ``adapter_model.safetensors``/``.bin`` only).

    Raises:
        FileNotFoundError: naming ``path``, when it is neither local nor a downloadable or cached
            hub repo.
    """
    return _resolve(path, revision, cache_dir, "Adapter", adapter=True)
