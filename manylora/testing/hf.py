"""transformers' ``from_pretrained`` for a checkpoint folder or a GGUF file."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def hf_causal_lm(path: str | Path, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` of a checkpoint folder, or of a ``.gguf``
    file (its folder with ``gguf_file=``: transformers dequantizes it through the ``gguf``
    package, into ``dtype``).

    Raises:
        OSError, ValueError: transformers' own, for a path it cannot load.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    **kwargs)
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
