"""``manylora convert-lora``: a PEFT LoRA adapter → TensorRT-LLM's LoRA tensor files.

Writes ``model.lora_weights.npy`` ``[1, N, W]`` (in the storage dtype; bfloat16 as numpy
``'|V2'``) and ``model.lora_config.npy`` ``[1, N, 3|4]`` int32, as TensorRT-LLM's
``examples/hf_lora_convert.py`` does; manylora serves the result through
``LoRARequest(name, id, out_dir)``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from manylora.lora.formats.trtllm import STORAGE_DTYPES
from manylora.lora.formats.trtllm_convert import peft_to_trtllm
from manylora.lora.formats.trtllm_npy import write_trtllm_dir


def convert_lora(input_dir: str, output_dir: str, storage_type: str,
                 base_model: str | None = None) -> tuple[Path, int]:
    """Convert the PEFT adapter in ``input_dir`` and write it to ``output_dir``.

    Args:
        storage_type: ``"float16"``, ``"bfloat16"`` or ``"float32"``.
        base_model: the base checkpoint directory; needed for DoRA adapters only.

    Returns:
        ``(output directory, number of rows)``.

    Raises:
        LoRAAdapterError: as ``peft_to_trtllm``.
        ValueError: an unknown ``storage_type``.
        OSError: the output cannot be written.
    """
    if storage_type not in STORAGE_DTYPES:
        raise ValueError(f"storage type {storage_type!r} is not one of "
                         f"{', '.join(STORAGE_DTYPES)}")
    if not Path(input_dir).is_dir():
        raise ValueError(f"{input_dir} is not a directory")
    if base_model is not None and not Path(base_model).is_dir():
        raise ValueError(f"base model {base_model} is not a directory")
    weights, config = peft_to_trtllm(input_dir, STORAGE_DTYPES[storage_type], base_model)
    return write_trtllm_dir(output_dir, weights, config), config.shape[1]


def run(args: argparse.Namespace) -> int:
    """The ``convert-lora`` subcommand: convert, report, exit 0.

    Raises:
        SystemExit: with a one-line message naming the problem (no traceback).
    """
    try:
        out, rows = convert_lora(args.input, args.output, args.storage_type, args.base_model)
    except (ValueError, OSError) as e:  # LoRAAdapterError is a ValueError
        raise SystemExit(f"manylora convert-lora: error: {e}") from None
    print(f"wrote {rows} module-layer rows ({args.storage_type}) to {out}")
    return 0
