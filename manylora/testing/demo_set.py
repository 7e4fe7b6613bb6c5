"""The demo set: a llama base checkpoint and four peft adapters of different shapes, built
once under a folder and reused while its build arguments stay the same."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from manylora.testing.adapters import make_peft_adapter
from manylora.testing.checkpoint import make_checkpoint

logger = logging.getLogger(__name__)


# name -> make_peft_adapter keyword arguments for the demo set.
DEMO_ADAPTER_SPECS: dict[str, dict[str, Any]] = {
    "sql": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "seed": 1},
    "chat": {
        "r": 16,
        "lora_alpha": 16,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        "use_rslora": True,
        "seed": 2,
    },
    "code": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["o_proj", "down_proj", "gate_proj", "up_proj"],
        "layers_to_transform": [1],
        "seed": 3,
    },
    "math": {
        "r": 32,
        "lora_alpha": 32,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "rank_pattern": {"o_proj": 8},
        "alpha_pattern": {"q_proj": 64},
        "seed": 4,
    },
}


@dataclass
class DemoSet:
    """A demo base checkpoint and its adapters.

    Attributes:
        base_dir: the llama checkpoint directory (see :func:`make_checkpoint`).
        adapters: adapter name -> peft adapter directory (see :func:`make_peft_adapter`).
    """

    base_dir: Path
    adapters: dict[str, Path] = field(default_factory=dict)


def make_demo_set(root: str | Path, **checkpoint_kwargs: Any) -> DemoSet:
    """Build (once) a llama base plus the four :data:`DEMO_ADAPTER_SPECS` adapters under ``root``.

    Layout: ``root/base`` (checkpoint + tokenizer), ``root/adapters/<name>`` for ``sql`` (r=8,
    q/v), ``chat`` (r=16, all seven projections, rsLoRA), ``code`` (r=4, o/down/gate/up, layer 1
    only) and ``math`` (r=32, q/k/v/o, rank_pattern ``{"o_proj": 8}``, alpha_pattern
    ``{"q_proj": 64}``), and a ``root/DONE`` marker (JSON of the build arguments) written last.
    If the marker exists with the same arguments the set is reused; otherwise any partial
    contents of ``root/base`` and ``root/adapters`` are removed and everything is rebuilt.

    Args:
        root: directory to build in (created if missing).
        checkpoint_kwargs: extra :func:`make_checkpoint` arguments (need >= 2 layers).

    Returns:
        A :class:`DemoSet` with absolute paths.
    """
    root = Path(root).absolute()
    base_dir = root / "base"
    adapters = {name: root / "adapters" / name for name in DEMO_ADAPTER_SPECS}
    marker = root / "DONE"
    signature = json.dumps(
        {"checkpoint": checkpoint_kwargs, "adapters": DEMO_ADAPTER_SPECS},
        sort_keys=True,
        default=str,
    )
    if marker.exists() and marker.read_text() == signature:
        logger.debug("reusing demo set at %s", root)
        return DemoSet(base_dir=base_dir, adapters=adapters)

    marker.unlink(missing_ok=True)
    for stale in (base_dir, root / "adapters"):
        if stale.exists():
            shutil.rmtree(stale)
    root.mkdir(parents=True, exist_ok=True)
    make_checkpoint(base_dir, "llama", **checkpoint_kwargs)
    for name, spec in DEMO_ADAPTER_SPECS.items():
        make_peft_adapter(base_dir, adapters[name], **spec)
    marker.write_text(signature)
    logger.info("built demo set at %s", root)
    return DemoSet(base_dir=base_dir, adapters=adapters)
