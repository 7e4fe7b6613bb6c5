"""Read an adapter from whatever form a ``LoRARequest`` names it in: a PEFT directory, a
directory of TensorRT-LLM's ``.npy`` files, or TensorRT-LLM's tensors in the request."""

from __future__ import annotations

import os
from pathlib import Path

from manylora.lora.adapter import LoRAAdapter, LoRAAdapterError
from manylora.lora.formats.files import is_present
from manylora.lora.formats.peft import load_peft_adapter
from manylora.lora.formats.peft_config import check_peft_config, may_target_vocab
from manylora.lora.formats.target import AdapterTarget
from manylora.lora.formats.trtllm import adapter_from_trtllm
from manylora.lora.formats.trtllm_npy import CONFIG_FILE, WEIGHTS_FILE, read_trtllm_dir
from manylora.lora_request import LoRARequest

#: Every file an adapter directory is read from (PEFT, then TensorRT-LLM's); nothing else
#: under it is opened.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin",
                 WEIGHTS_FILE, CONFIG_FILE)


def is_trtllm_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds TensorRT-LLM's ``model.lora_weights.npy`` or
    ``model.lora_config.npy``, of any file type (then it is read in that format, not as
    PEFT; the read refuses what is not a regular file)."""
    path = Path(path)
    return is_present(path / WEIGHTS_FILE) or is_present(path / CONFIG_FILE)


def check_adapter_dir(request: LoRARequest, path: str | os.PathLike,
                      target: AdapterTarget) -> bool:
    """The checks of an adapter directory that read no tensor (its config only, at most
    ``MAX_CONFIG_BYTES``, opened only if it is a regular file, so this never blocks on a
    FIFO), so a request can be refused at once while the weights are read later, on a
    loader thread; whether its read may enter a collective under tensor parallelism: a DoRA
    adapter (``use_dora``), or one whose ``target_modules`` may name ``embed_tokens`` /
    ``lm_head`` (peft saves their base tables with them, checked against the model's).

    Raises:
        LoRAAdapterError: ``path`` is not a directory; a TensorRT-LLM directory without
            one of its two ``.npy`` files; a PEFT directory whose ``adapter_config.json`` is
            missing or bad (``check_peft_config``) or that has no weights file, or whose
            request carries ``alora_invocation_tokens`` (its config says).
    """
    name, path = request.lora_name, Path(path)
    if not path.is_dir():
        raise LoRAAdapterError(f"adapter {name!r}: {path} is not a directory")
    if is_trtllm_dir(path):
        for file in (WEIGHTS_FILE, CONFIG_FILE):
            if not is_present(path / file):
                raise LoRAAdapterError(f"adapter {name!r}: {file} is missing")
        return False
    _refuse_request_invocation(request)
    cfg = check_peft_config(path, name, target)
    if not any(is_present(path / f) for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise LoRAAdapterError(
            f"adapter {name!r}: no adapter_model.safetensors or adapter_model.bin")
    return bool(cfg.get("use_dora")) or may_target_vocab(cfg)


def load_adapter_dir(request: LoRARequest, path: str | os.PathLike,
                     target: AdapterTarget) -> LoRAAdapter:
    """Load the adapter in directory ``path`` into host memory.

    A directory with TensorRT-LLM's ``model.lora_weights.npy`` / ``model.lora_config.npy`` is
    read in TensorRT-LLM's format (``read_trtllm_dir`` + ``adapter_from_trtllm``), any other
    as a PEFT adapter (``load_peft_adapter``).

    Raises:
        LoRAAdapterError: as ``read_trtllm_dir`` and ``adapter_from_trtllm`` (one of the two
            ``.npy`` files missing, too), or as ``load_peft_adapter``.
    """
    if is_trtllm_dir(path):
        weights, config = read_trtllm_dir(path, request.lora_name, target)
        return adapter_from_trtllm(request.lora_int_id, request.lora_name, weights, config,
                                   target, request.alora_invocation_tokens)
    _refuse_request_invocation(request)
    return load_peft_adapter(request, path, target)


def _refuse_request_invocation(request: LoRARequest) -> None:
    if request.alora_invocation_tokens is not None:
        raise LoRAAdapterError(
            f"adapter {request.lora_name!r}: alora_invocation_tokens in the request is for "
            "TensorRT-LLM's format; a PEFT adapter is activated by its adapter_config.json")


def adapter_from_request(request: LoRARequest, target: AdapterTarget) -> LoRAAdapter:
    """The adapter a request carries as TensorRT-LLM's ``LoraConfig`` tensors
    (``request.weights [N, W]``, ``request.config [N, 3|4]``; see ``adapter_from_trtllm``).

    Raises:
        LoRAAdapterError: the request carries no tensors, or as ``adapter_from_trtllm``.
    """
    if not request.has_tensors:
        raise LoRAAdapterError(f"adapter {request.lora_name!r}: the request carries no "
                               "weights/config tensors")
    return adapter_from_trtllm(request.lora_int_id, request.lora_name, request.weights,
                               request.config, target, request.alora_invocation_tokens)
