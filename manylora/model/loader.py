"""From a checkpoint directory to a ready model: config, the registry's class, weights."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from manylora.checkpoint.gguf import gguf_config, is_gguf
from manylora.checkpoint.weights import (
    CheckpointError,
    ModelWeightsLoader,
    full_shape,
    shard_tensor,
)
from manylora.config import ModelConfig
from manylora.distributed.parallel_state import TPGroup
from manylora.model.registry import model_class

logger = logging.getLogger(__name__)


def load_hf_config(model_dir: str | os.PathLike, trust_remote_code: bool = False):
    """``config.json`` through transformers' ``AutoConfig``; for a ``.gguf`` file, the config
    transformers builds from its metadata (:func:`~manylora.checkpoint.gguf.gguf_config`).

    Raises:
        CheckpointError: the directory has no readable config.json, or the GGUF file is
            unreadable, split or of an architecture transformers cannot read.
    """
    if is_gguf(model_dir):
        return gguf_config(model_dir, trust_remote_code)
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read the model config in {model_dir}: {e}") from e


#: ``load_format`` values: read the checkpoint, or random weights of the right shapes.
LOAD_FORMATS = ("auto", "dummy")

#: Range of the uniform random weights of ``load_format="dummy"`` (vLLM's dummy loader).
_DUMMY_RANGE = 1e-3


def load_model(model_dir: Path, cfg: ModelConfig, device: torch.device,
               key_dict: Mapping[str, str | list[str]] | None = None,
               load_format: str = "auto", tp: TPGroup | None = None) -> nn.Module:
    """Allocate the model (this rank's shard of it) on ``device`` and fill it from the
    checkpoint (TensorRT-LLM's loader). The class is the model registry's for
    ``cfg.architecture`` (``manylora.model.registry``); each layer's linear method
    (``manylora.ops.linear_method``) laid its weights out for the loader and then reworks
    them (``process_weights_after_loading``), as vLLM's loader does.

    Args:
        model_dir: the checkpoint directory (or one weight file, e.g. a ``.gguf``).
        cfg: the model's architecture, shape and dtype (the whole model's, or
            ``cfg.shard(tp.size)``).
        device: where the weights live.
        key_dict: extra key translations (TensorRT-LLM's ``customized_key_dict``).
        load_format: ``"auto"`` reads the weights (only the rank's slices of them);
            ``"dummy"`` (vLLM's) fills every weight with seeded uniform noise in ±1e-3 and
            reads no weight file, for benchmarks. Under tensor parallelism each rank draws
            every whole parameter from the same seeded generator and keeps its slice, so the
            ranks together hold exactly the one-rank model's dummy weights.
        tp: the tensor-parallel group (None: one rank).

    Logs the parameters' bytes (``weight_bytes``) and the base's format.

    Raises:
        CheckpointError: missing, corrupt or mis-shaped weight files.
        ValueError: an unknown ``load_format``, an architecture the registry does not hold,
            or a model that does not split over ``tp``.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}: use one of {LOAD_FORMATS}")
    model = model_class(cfg.architecture)(cfg, device, tp)
    if load_format == "dummy":
        fill_dummy_weights(model, device)
    else:
        rank = model.tp
        ModelWeightsLoader(model_dir, key_dict).load_model(model, rank.rank, rank.size)
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    quant = cfg.quantization
    logger.info("Model weights: %.2f GiB on %s (%s)", weight_bytes(model) / 2**30, device,
                f"{quant.name} quantized" if quant is not None
                else str(cfg.dtype).removeprefix("torch."))
    return model.eval()


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters take on their device (this rank's shard; quantized
    weights at their stored width, with their scales and zero points)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, device: torch.device) -> None:
    """Seeded noise, parameter by parameter: uniform in ±1e-3 for 16/32-bit parameters (and
    for FP8 ones, converted), uniform bits for integer ones (packed quantized weights); a
    sliced parameter draws its whole tensor (the one-rank shape) and keeps its
    ``tp_slices``."""
    gen = torch.Generator(device).manual_seed(0)
    for param in model.parameters():
        tp_slices = getattr(param, "tp_slices", None)
        shape = param.shape if tp_slices is None else full_shape(param.shape, tp_slices)
        whole = _dummy(shape, param.dtype, device, gen)
        param.copy_(whole if tp_slices is None else shard_tensor(whole, tp_slices))


def _dummy(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return torch.empty(shape, dtype=dtype, device=device).uniform_(
            -_DUMMY_RANGE, _DUMMY_RANGE, generator=gen)
    if dtype.is_floating_point:
        return torch.empty(shape, dtype=torch.float32, device=device).uniform_(
            -_DUMMY_RANGE, _DUMMY_RANGE, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype, device=device,
                         generator=gen)
