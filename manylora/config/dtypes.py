"""The dtypes and device a model runs on, from their user-facing names."""

from __future__ import annotations

from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` → ``cuda`` when a GPU is visible, else ``cpu``; anything else as given.

    Raises:
        ValueError: ``device`` names CUDA but no GPU is visible.
    """
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for, but no CUDA GPU is visible")
    return dev


#: ``lora_dtype`` values (vLLM's ``--lora-dtype``).
LORA_DTYPE_NAMES = ("auto", "float16", "bfloat16", "float32")


def resolve_lora_dtype(lora_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the adapter slots, the host cache and the LoRA kernels' operands.

    ``"auto"``: the model's. Otherwise the model's or float32: the kernels run the
    activations in the slots' dtype, and float32 holds every float16 / bfloat16 activation
    exactly (a delta computed in float32 is rounded once, to the model's dtype), where a
    narrower slot dtype would round the base output of every row of the batch.

    Raises:
        ValueError: an unknown name, or a dtype other than the model's and float32.
    """
    if lora_dtype not in LORA_DTYPE_NAMES:
        raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPE_NAMES)}, got "
                         f"{lora_dtype!r}")
    if lora_dtype == "auto":
        return model_dtype
    dtype = _DTYPES[lora_dtype]
    if dtype not in (model_dtype, torch.float32):
        raise ValueError(f"lora_dtype {lora_dtype} on a {str(model_dtype).removeprefix('torch.')} "
                         "model: the LoRA slots must be in the model's dtype or float32 "
                         "(use 'auto' or 'float32')")
    return dtype


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, hf_config: Any) -> torch.dtype:
    """The dtype weights and activations run in.

    ``"auto"``: float32 on CPU; on CUDA the checkpoint's own dtype when it is bfloat16
    or float16, otherwise bfloat16 (vLLM's rule, except that CPU stays in float32).

    Raises:
        ValueError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of 'auto', {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt)
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16
