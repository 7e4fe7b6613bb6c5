"""Tiny FP8 checkpoints for tests, made from a dense one (``make_checkpoint``'s), each with a
dense float32 twin holding the DEQUANTIZED weights (the transformers + peft reference).

* ``write_fp8_checkpoint``: transformers' fine-grained FP8 (``weight_block_size``: per
  block ``scale = amax / 448``, stored as ``weight_scale_inv [ceil(N / bn), ceil(K / bk)]``,
  the rule of transformers' ``FineGrainedFP8`` quantizer and DeepSeek-V3's release) or
  serialized per-tensor FP8 (AutoFP8's layout: a 0-d ``weight_scale`` and, static, a 0-d
  ``input_scale`` per linear layer).
* ``write_compressed_tensors_fp8``: a compressed-tensors ``float-quantized`` checkpoint
  written by compressed-tensors itself (``apply_quantization_config``, its
  ``calculate_qparams``, ``ModelCompressor.compress_model`` and ``update_config``);
  the twin's weights are compressed-tensors' own ``dequantize``.

Static input scales are calibrated on ``calibration_ids`` (the dense model's inputs to each
linear layer: ``amax / 448``).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def _copy(dense_dir: Path, out_dir: Path) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(dense_dir, out_dir)


def _input_amax(dense_dir: Path, ids: Sequence[int]) -> dict[str, float]:
    """Each linear layer's largest input magnitude over a forward of ``ids``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(dense_dir,
                                                              dtype=torch.float32)
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if _LINEAR.match(name + ".weight"):
            def hook(mod, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(torch.tensor([list(ids)]))
    for h in hooks:
        h.remove()
    return amax


def write_fp8_checkpoint(dense_dir: str | Path, out_dir: str | Path, *,
                         block: tuple[int, int] | None = None,
                         activation_scheme: str = "dynamic",
                         calibration_ids: Sequence[int] = (1, 2, 3, 4, 5, 6, 7, 8)
                         ) -> tuple[Path, Path]:
    """Quantize ``dense_dir``'s decoder linear layers to FP8 e4m3 into ``out_dir``.

    Args:
        block: ``(bn, bk)``: fine-grained block scales (``weight_scale_inv``); None: one
            ``weight_scale`` per tensor.
        activation_scheme: ``"dynamic"`` or ``"static"`` (per-tensor only: an
            ``input_scale`` calibrated on ``calibration_ids``).

    Returns:
        ``(out_dir, reference_dir)``: the FP8 checkpoint and its dequantized float32 twin
        (``out_dir`` + ``"-ref"``).
    """
    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    ref_dir = out_dir.with_name(out_dir.name + "-ref")
    _copy(dense_dir, out_dir)
    _copy(dense_dir, ref_dir)
    tensors = load_file(dense_dir / "model.safetensors")
    amax = (_input_amax(dense_dir, calibration_ids) if activation_scheme == "static"
            else {})
    quant, ref = {}, {}
    for key, w in tensors.items():
        if not _LINEAR.match(key):
            quant[key] = ref[key] = w
            continue
        w = w.float()
        if block is None:
            scale = (w.abs().max() / FP8_MAX).clamp_min(1e-12)
            q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            quant[key], quant[key + "_scale"] = q, scale.reshape(())
            ref[key] = q.float() * scale
            if activation_scheme == "static":
                module = key[:-len(".weight")]
                quant[module + ".input_scale"] = torch.tensor(amax[module] / FP8_MAX)
        else:
            bn, bk = block
            n, k = w.shape
            rows, cols = -(-n // bn), -(-k // bk)
            padded = torch.nn.functional.pad(w, (0, cols * bk - k, 0, rows * bn - n))
            blocks = padded.view(rows, bn, cols, bk)
            scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
            full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
            q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            quant[key], quant[key + "_scale_inv"] = q, scale
            ref[key] = q.float() * full
    save_file(quant, out_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(ref, ref_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense_dir / "config.json").read_text())
    qcfg = {"quant_method": "fp8", "activation_scheme": activation_scheme,
            "modules_to_not_convert": ["lm_head"]}
    if block is not None:
        qcfg["weight_block_size"] = list(block)
    config["quantization_config"] = qcfg
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir, ref_dir


def write_compressed_tensors_fp8(dense_dir: str | Path, out_dir: str | Path, *,
                                 weights: str = "channel",
                                 activations: str | None = "token",
                                 block: tuple[int, int] = (32, 32),
                                 calibration_ids: Sequence[int] = (1, 2, 3, 4, 5, 6, 7, 8)
                                 ) -> tuple[Path, Path]:
    """A compressed-tensors FP8 checkpoint of ``dense_dir`` into ``out_dir``, written by
    compressed-tensors' API.

    Args:
        weights: ``"tensor"``, ``"channel"`` or ``"block"`` (``block`` rows x columns).
        activations: ``"token"`` (dynamic), ``"static"`` (per tensor, calibrated on
            ``calibration_ids``), ``"group"`` (dynamic, ``block[1]`` columns: with block
            weights) or None (weight-only, W8A16).

    Returns:
        ``(out_dir, reference_dir)`` as ``write_fp8_checkpoint``.
    """
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
        dequantize,
        quantize,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    ref_dir = out_dir.with_name(out_dir.name + "-ref")
    _copy(dense_dir, ref_dir)
    wargs = QuantizationArgs(num_bits=8, type="float", strategy=weights, symmetric=True,
                             dynamic=False,
                             block_structure=list(block) if weights == "block" else None)
    aargs = None
    if activations == "static":
        aargs = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True,
                                 dynamic=False)
    elif activations == "group":
        aargs = QuantizationArgs(num_bits=8, type="float", strategy="group",
                                 group_size=block[1], symmetric=True, dynamic=True)
    elif activations is not None:
        aargs = QuantizationArgs(num_bits=8, type="float", strategy=activations,
                                 symmetric=True, dynamic=True)
    amax = _input_amax(dense_dir, calibration_ids) if activations == "static" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(dense_dir,
                                                              dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], weights=wargs, input_activations=aargs)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head"],
        quantization_status="initialized"))
    ref = load_file(dense_dir / "model.safetensors")
    with torch.no_grad():
        for name, module in model.named_modules():
            if not _LINEAR.match(name + ".weight"):
                continue
            w = module.weight.float()
            if weights == "tensor":
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            elif weights == "channel":
                lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
            else:
                bn, bk = block
                n, k = w.shape
                rows, cols = -(-n // bn), -(-k // bk)
                padded = torch.nn.functional.pad(w, (0, cols * bk - k, 0, rows * bn - n))
                blocks = padded.view(rows, bn, cols, bk)
                lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
            scale, zero = calculate_qparams(lo, hi, wargs)
            module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(
                module.weight_scale.dtype)
            module.weight_zero_point.data = zero.reshape(module.weight_zero_point.shape)
            if activations == "static":
                a = torch.tensor([amax[name]])
                s, z = calculate_qparams(-a, a, aargs)
                module.input_scale.data = s.reshape(module.input_scale.shape).to(
                    module.input_scale.dtype)
                module.input_zero_point.data = z.reshape(module.input_zero_point.shape)
            q = quantize(w, module.weight_scale, module.weight_zero_point, wargs)
            ref[name + ".weight"] = dequantize(q, module.weight_scale,
                                               module.weight_zero_point, wargs).float()
    compressor = ModelCompressor.from_pretrained_model(model,
                                                       quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
    for extra in dense_dir.iterdir():
        if extra.name.startswith("tokenizer") or extra.name in ("special_tokens_map.json",
                                                                "generation_config.json"):
            shutil.copy(extra, out_dir / extra.name)
    save_file(ref, ref_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir, ref_dir
