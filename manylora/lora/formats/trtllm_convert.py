"""A converter from PEFT LoRA adapters to TensorRT-LLM's tensors (``manylora convert-lora``,
TensorRT-LLM's ``examples/hf_lora_convert.py``)."""

from __future__ import annotations

import os

import torch

from manylora.checkpoint.weights import CheckpointError, ModelWeightsLoader
from manylora.config import MODEL_LAYER
from manylora.lora.adapter import LoRAAdapterError, check_delta
from manylora.lora.dora import dora_row_norm
from manylora.lora.formats.peft import dora_scale_from_magnitude, group_peft_tensors
from manylora.lora.formats.peft_config import component_modules, read_peft_config
from manylora.lora.formats.peft_scaling import PeftScaling
from manylora.lora.formats.peft_weights import check_peft_pair, read_peft_tensors
from manylora.lora.formats.trtllm import check_storage_dtype, pad_rows
from manylora.lora.formats.trtllm_modules import HF_TO_TRTLLM


class _BaseWeights:
    """The base projections' weights of an HF checkpoint (single or sharded safetensors,
    ``.bin``), read on demand: what DoRA's magnitudes are normalized against."""

    def __init__(self, model_dir: str | os.PathLike) -> None:

        try:
            self._loader = ModelWeightsLoader(model_dir)
        except CheckpointError as e:
            raise LoRAAdapterError(f"base model {model_dir}: {e}") from e
        self.model_dir = model_dir

    def weight(self, layer: int, module: str) -> torch.Tensor:
        """``[out, in]`` of one projection; a fused module's parts concatenated (dim 0), or
        the checkpoint's own fused tensor (Phi-3's ``qkv_proj`` / ``gate_up_proj``,
        ``ModelWeightsLoader.fused_key``).

        Raises:
            LoRAAdapterError: the checkpoint has no such tensor.
        """
        block = "self_attn" if component_modules(module)[0] in (
            "q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        key = f"model.layers.{layer}.{block}.{module}.weight"
        try:
            return torch.cat(self._loader.load(key))
        except CheckpointError as e:
            raise LoRAAdapterError(f"base model {self.model_dir}: {e} (needed to normalize "
                                   "the DoRA magnitudes)") from e


def peft_to_trtllm(peft_dir: str | os.PathLike, storage_dtype: torch.dtype,
                   base_model_dir: str | os.PathLike | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert a PEFT LoRA adapter to TensorRT-LLM's tensors (``hf_lora_convert.py``'s job).

    Reads ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern``,
    ``alpha_pattern``, ``use_dora``) and ``adapter_model.safetensors`` / ``.bin``; each (layer,
    module) becomes one row, the scaling folded into B; fused ``qkv_proj`` / ``gate_up_proj``
    modules become attn_qkv (0) / mlp_gate_up (18) rows. No base model is needed, except for
    DoRA, whose magnitudes are normalized to ``m / ||W + BA||`` against the base weights.

    Args:
        peft_dir: the PEFT adapter directory.
        storage_dtype: float16, bfloat16 or float32.
        base_model_dir: an HF checkpoint directory (``model.layers.{i}.{self_attn|mlp}.
            {proj}.weight`` in single or sharded safetensors or ``.bin`` files); DoRA only.

    Returns:
        ``(weights [1, N, W] in storage_dtype, config [1, N, 3] int32)``, rows ordered by
        (layer, module id) and zero padded; for DoRA config is ``[1, N, 4]`` (is_dora = 1) and
        each row ends with its ``Ho`` scales.

    Raises:
        ValueError: an unsupported ``storage_dtype``.
        LoRAAdapterError: an activated LoRA (``alora_invocation_tokens``: the format cannot
            hold them); what ``load_peft_adapter`` refuses without a base model (missing
            or corrupt files, unsupported config, unknown modules (``embed_tokens`` and
            ``lm_head`` too: the format has no module id for them), missing A/B/magnitude,
            NaN/Inf); a module given fused and on its own; a DoRA adapter without
            ``base_model_dir``, or whose base weights are missing or of another shape.
    """
    check_storage_dtype(storage_dtype)
    name = str(peft_dir)
    cfg = read_peft_config(peft_dir, name)
    if cfg.get("alora_invocation_tokens") is not None:
        raise LoRAAdapterError(
            f"adapter {name!r} is an activated LoRA (alora_invocation_tokens "
            f"{cfg['alora_invocation_tokens']}), which TensorRT-LLM's tensors cannot hold: "
            "serve it as PEFT, or convert a copy without the field and give the tokens in "
            "the request (LoRARequest.alora_invocation_tokens)")
    pairs = group_peft_tensors(read_peft_tensors(peft_dir, name), name)
    if not pairs:
        raise LoRAAdapterError(f"adapter {name!r}: {peft_dir} holds no LoRA weights")
    use_dora = bool(cfg.get("use_dora"))
    if use_dora and base_model_dir is None:
        raise LoRAAdapterError(f"adapter {name!r} is DoRA: its magnitudes must be normalized "
                               "against the base model's weights; give the base model "
                               "(--base-model DIR)")
    base = _BaseWeights(base_model_dir) if use_dora else None
    scaling = PeftScaling(cfg, name)
    rows: dict[tuple[int, int], tuple[torch.Tensor, list[int]]] = {}
    seen: dict[tuple[int, str], str] = {}
    for (layer, module_key), ab in sorted(pairs.items()):
        module = module_key.rsplit(".", 1)[-1]
        if layer == MODEL_LAYER:
            raise LoRAAdapterError(f"adapter {name!r} targets {module}, for which TensorRT-LLM's "
                                   "LoRA format has no module id")
        check_peft_pair(name, module_key, ab, use_dora)
        for part in component_modules(module):
            if (layer, part) in seen:
                raise LoRAAdapterError(f"adapter {name!r}: {part} of layer {layer} is given by "
                                       f"both {seen[(layer, part)]} and {module_key}")
            seen[(layer, part)] = module_key
        flat, rank, scales = _peft_row(name, layer, module_key, ab, scaling, base)
        mtype = HF_TO_TRTLLM[module]
        row = flat if scales is None else torch.cat([flat, scales])
        rows[(layer, int(mtype))] = (row, [int(mtype), layer, rank] + ([1] if use_dora else []))
    ordered = [rows[k] for k in sorted(rows)]
    weights = pad_rows([r.to(storage_dtype) for r, _ in ordered], storage_dtype)
    config = torch.tensor([c for _, c in ordered], dtype=torch.int32)
    return weights[None], config[None]


def _peft_row(name: str, layer: int, module_key: str, ab: dict[str, torch.Tensor],
              scaling: PeftScaling, base: _BaseWeights | None,
              ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """One PEFT module (checked by ``check_peft_pair``) → (A, scaled B in float32 as one flat
    row, rank, DoRA scales)."""
    a, b = ab["A"], ab["B"]
    rank = a.shape[0]
    a = a.float()
    b = b.float() * scaling(module_key, rank)
    check_delta(f"adapter {name!r}: {module_key}", a, b)
    scales = None
    if base is not None:
        scales = _peft_dora_scales(name, layer, module_key, ab["M"], a, b, base)
    return torch.cat([a.reshape(-1), b.reshape(-1)]), rank, scales


def _peft_dora_scales(name: str, layer: int, module_key: str, magnitude: torch.Tensor,
                      a: torch.Tensor, b: torch.Tensor, base: _BaseWeights) -> torch.Tensor:
    """``m / ||W + BA||`` (float32 ``[out]``) against the base checkpoint's weight."""

    magnitude = magnitude.reshape(-1).float()
    weight = base.weight(layer, module_key.rsplit(".", 1)[-1])
    if magnitude.shape[0] != b.shape[0] or weight.shape != (b.shape[0], a.shape[1]):
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_A {tuple(a.shape)}, lora_B "
            f"{tuple(b.shape)} and lora_magnitude_vector {tuple(magnitude.shape)}, but the base "
            f"weight is {tuple(weight.shape)}: the adapter was trained for another base model")
    return dora_scale_from_magnitude(magnitude, dora_row_norm(weight, a, b),
                                     f"adapter {name!r}: {module_key}")
