"""The filesystem LoRA resolver (vLLM's ``lora_filesystem_resolver``): a request whose
``model`` is no served name, but names an adapter directory directly under one of the
``--lora-root`` directories, loads that adapter on its first request.

:func:`find_adapter_dir` is the lookup alone (bounded ``stat`` calls, no read of a tensor);
``FilesystemResolver`` binds it to the roots; ``OpenAIServingModels.resolve_lora`` runs it on
a thread and loads what it finds once, however many requests ask for the name at the same
time.
"""

from __future__ import annotations

import logging
from pathlib import Path

from manylora.entrypoints.openai.errors import OpenAIError
from manylora.entrypoints.openai.serving_models import check_under_roots
from manylora.lora.formats.loader import CONFIG_FILE, WEIGHTS_FILE

logger = logging.getLogger(__name__)

__all__ = ["FilesystemResolver", "find_adapter_dir", "resolvable_name"]

#: Files that make a directory an adapter: PEFT's config, or TensorRT-LLM's two arrays.
_MARKERS = (("adapter_config.json",), (WEIGHTS_FILE, CONFIG_FILE))


def resolvable_name(name: str) -> bool:
    """Whether ``name`` may name a directory under a root: one path component (no ``/`` or
    ``\\``), not ``.`` or ``..``, not hidden (a leading ``.``), no NUL. Anything else is
    never looked up (such a name is simply unknown: 404)."""
    return bool(name) and not name.startswith(".") and not any(
        c in name for c in ("/", "\\", "\x00"))


def find_adapter_dir(name: str, roots: list[Path]) -> Path | None:
    """The adapter directory ``root / name`` of the first root that has one, resolved, or
    None: the name is not resolvable (:func:`resolvable_name`), no root has such a
    directory, it (or an adapter file in it) leads outside the roots by a symlink, or it
    holds no adapter (neither ``adapter_config.json`` nor TensorRT-LLM's two ``.npy``
    files). Touches the filesystem: call it off the event loop. Never raises for a bad
    name or path: why a name did not resolve is logged at DEBUG, the client sees an
    unknown model."""
    if not resolvable_name(name):
        return None
    for root in roots:
        try:
            target = check_under_roots(name, [root])
        except OpenAIError as e:
            logger.debug("LoRA resolver: %r under %s: %s", name, root, e.message)
            continue
        if any(all((target / f).is_file() for f in marker) for marker in _MARKERS):
            return target
        logger.debug("LoRA resolver: %s holds no adapter", target)
    return None


class FilesystemResolver:
    """vLLM's filesystem resolver over the ``--lora-root`` directories: called with a
    model name, :func:`find_adapter_dir` under ``roots`` (call it off the event loop).

    Args:
        roots: the directories adapters may be loaded from.
    """

    def __init__(self, roots: list[Path]) -> None:
        self.roots = [Path(r) for r in roots]

    def __call__(self, name: str) -> Path | None:
        return find_adapter_dir(name, self.roots)
