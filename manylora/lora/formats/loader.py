"""Read an adapter from whatever form a ``LoRARequest`` names it in."""

from __future__ import annotations

import os

from manylora.lora.adapter import LoRAAdapter
from manylora.lora.formats.peft import AdapterTarget, load_peft_adapter
from manylora.lora.request import LoRARequest


def load_adapter_dir(request: LoRARequest, path: str | os.PathLike,
                     target: AdapterTarget) -> LoRAAdapter:
    """Load the adapter in directory ``path`` (PEFT) into host memory.

    Raises:
        LoRAAdapterError: as ``load_peft_adapter``.
    """
    return load_peft_adapter(request, path, target)
