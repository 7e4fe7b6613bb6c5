"""Tiny INT4 checkpoints (GPTQ, AWQ, compressed-tensors ``pack-quantized``) of a
``make_checkpoint`` model, and the dense float32 checkpoint of their dequantized weights
(what transformers + peft run as the reference).

Each decoder projection (``q/k/v/o_proj``, ``gate/up/down_proj``) is quantized by
round-to-nearest per group of input rows (the format matters here, not the quality), then
written as the format's writers write it: GPTQ's tensors and ``quantization_config`` as
AutoGPTQ / GPTQModel save them, AWQ's as AutoAWQ's GEMM packing saves them (both by this
module's packer, which tests check against those projects' unpacking rules), and
compressed-tensors' by compressed-tensors itself (``apply_quantization_config``, its
``calculate_qparams`` on each group's range, ``ModelCompressor.compress_model``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

#: The projections quantized, by the last part of their Hugging Face name.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: AutoAWQ's GEMM interleaving: nibble ``i`` of a word holds column ``AWQ_ORDER[i]``.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_nibbles(codes: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))
                 ) -> torch.Tensor:
    """Codes ``0 .. 15`` packed 8 per int32 word along ``dim`` (of 2): nibble ``i`` (bits
    ``4i .. 4i+3``) of word ``w`` holds entry ``8w + order[i]``."""
    codes = codes.to(torch.int64).movedim(dim, -1)
    groups = codes.reshape(*codes.shape[:-1], -1, 8)
    words = sum(groups[..., order[i]] << (4 * i) for i in range(8))
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _rtn(w: torch.Tensor, groups: torch.Tensor, n_groups: int, sym: bool,
         min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of ``w [N, K]`` with input row ``k`` in group ``groups[k]``:
    codes ``[N, K]``, float16 scales ``[G, N]``, zeros ``[G, N]`` (GPTQ's quantizer: a
    symmetric range has zero 8)."""
    n = w.shape[0]
    scales = torch.empty(n_groups, n, dtype=torch.float16)
    zeros = torch.empty(n_groups, n, dtype=torch.int64)
    for g in range(n_groups):
        part = w[:, groups == g]
        lo, hi = part.min(1).values.clamp(max=0), part.max(1).values.clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        scale = ((hi - lo) / 15).clamp(min=1e-4).half()
        zero = (torch.full_like(lo, 8) if sym
                else torch.round(-lo / scale.float()).clamp(min_zero, 15))
        scales[g], zeros[g] = scale, zero.long()
    s, z = scales.float()[groups].T, zeros[groups].T
    codes = torch.clamp(torch.round(w / s) + z, 0, 15).long()
    return codes, scales, zeros


def _copy(dense_dir: Path, out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(dense_dir, out)
    return out


def _set_quantization_config(out: Path, config: dict[str, Any] | None) -> None:
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    if config is not None:
        cfg["quantization_config"] = config
    path.write_text(json.dumps(cfg, indent=2))


def _projections(state: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k[:-len(".weight")] for k in state
                  if k.endswith(".weight") and k.split(".")[-2] in PROJECTIONS)


def write_int4_checkpoint(dense_dir: str | Path, out_dir: str | Path, fmt: str, *,
                          group_size: int = 32, sym: bool = True, desc_act: bool = False,
                          checkpoint_format: str = "gptq", seed: int = 0
                          ) -> tuple[Path, Path]:
    """Quantize the projections of the float32 checkpoint ``dense_dir`` to INT4.

    Args:
        dense_dir: a ``make_checkpoint`` folder (one ``model.safetensors``).
        out_dir: gets ``quantized/`` (the format's checkpoint) and ``dequantized/`` (its
            weights dequantized, float32, no ``quantization_config``).
        fmt: ``"gptq"`` or ``"awq"`` (compressed-tensors: ``write_ct_int4_checkpoint``).
        group_size: input rows per group; -1 (GPTQ): one group over the input.
        sym: symmetric (GPTQ; AWQ is always asymmetric).
        desc_act: GPTQ activation order: rows are assigned to groups in a seeded random
            order (one order per input, shared by the projections that read it), stored
            in ``g_idx``.
        checkpoint_format: GPTQ's ``"gptq"`` (zeros stored minus one) or ``"gptq_v2"``.
        seed: the activation order's seed.

    Returns:
        ``(quantized_dir, dequantized_dir)``.

    Raises:
        ValueError: an unknown ``fmt``.
    """
    if fmt not in ("gptq", "awq"):
        raise ValueError(f"unknown INT4 format {fmt!r}: use 'gptq' or 'awq'")
    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    quant, deq = _copy(dense_dir, out_dir / "quantized"), _copy(dense_dir, out_dir / "dequantized")
    state = load_file(dense_dir / "model.safetensors")
    qstate, dstate = dict(state), dict(state)
    gen = torch.Generator().manual_seed(seed)
    orders: dict[tuple[str, bool], torch.Tensor] = {}
    for name in _projections(state):
        w = state[name + ".weight"].float()
        n, k = w.shape
        size = k if group_size == -1 else group_size
        n_groups = -(-k // size)
        groups = torch.arange(k) // size
        if desc_act:
            # the projections that read one input (q/k/v, gate/up) share its order
            key = (name.rsplit(".", 1)[0], name.endswith(("o_proj", "down_proj")))
            if key not in orders:
                orders[key] = torch.randperm(k, generator=gen)
            groups = torch.empty(k, dtype=torch.int64)
            groups[orders[key]] = torch.arange(k) // size
        zero_floor = 1 if fmt == "gptq" and checkpoint_format == "gptq" else 0
        codes, scales, zeros = _rtn(w, groups, n_groups, sym and fmt == "gptq", zero_floor)
        dstate[name + ".weight"] = ((codes - zeros[groups].T).float()
                                    * scales.float()[groups].T).contiguous()
        del qstate[name + ".weight"]
        if fmt == "gptq":
            stored = (zeros - 1) & 0xF if checkpoint_format == "gptq" else zeros
            qstate[name + ".qweight"] = pack_nibbles(codes.T, 0)
            qstate[name + ".qzeros"] = pack_nibbles(stored, 1)
            qstate[name + ".scales"] = scales
            qstate[name + ".g_idx"] = groups.to(torch.int32)
        else:
            qstate[name + ".qweight"] = pack_nibbles(codes.T, 1, AWQ_ORDER)
            qstate[name + ".qzeros"] = pack_nibbles(zeros, 1, AWQ_ORDER)
            qstate[name + ".scales"] = scales
    save_file(qstate, quant / "model.safetensors", metadata={"format": "pt"})
    save_file(dstate, deq / "model.safetensors", metadata={"format": "pt"})
    if fmt == "gptq":
        config = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                  "desc_act": desc_act, "sym": sym, "damp_percent": 0.01,
                  "true_sequential": True, "static_groups": False,
                  "checkpoint_format": checkpoint_format, "lm_head": False,
                  "model_name_or_path": None, "model_file_base_name": None}
    else:
        config = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                  "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    _set_quantization_config(quant, config)
    return quant, deq


def write_ct_int4_checkpoint(dense_dir: str | Path, out_dir: str | Path, *,
                             strategy: str = "group", group_size: int = 32,
                             sym: bool = True) -> tuple[Path, Path]:
    """A compressed-tensors W4A16 ``pack-quantized`` checkpoint of the float32 checkpoint
    ``dense_dir``, written by compressed-tensors: its scheme applied to every projection
    (``lm_head`` ignored), each weight's scale and zero point from compressed-tensors'
    ``calculate_qparams`` over the group's (or row's, ``strategy="channel"``) range, then
    compressed and saved by its ``ModelCompressor``.

    Returns:
        ``(quantized_dir, dequantized_dir)``: the dequantized weights are
        compressed-tensors' own ``fake_quantize`` of each weight, float32.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from manylora.testing.hf import hf_causal_lm

    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    deq = _copy(dense_dir, out_dir / "dequantized")
    quant = out_dir / "quantized"
    model = hf_causal_lm(dense_dir, dtype=torch.float32)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy=strategy,
                            group_size=group_size if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                quantization_status=QuantizationStatus.FROZEN,
                                format="pack-quantized")
    apply_quantization_config(model, config)
    dstate = load_file(dense_dir / "model.safetensors")
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.split(".")[-1] not in PROJECTIONS:
                continue
            w = module.weight.data
            rows = w.reshape(w.shape[0], -1, group_size) if strategy == "group" \
                else w.unsqueeze(1)
            scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
            dstate[name + ".weight"] = fake_quantize(
                w, module.weight_scale, getattr(module, "weight_zero_point", None),
                args).contiguous()
    save_file(dstate, deq / "model.safetensors", metadata={"format": "pt"})
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(quant)
    compressor.update_config(str(quant))
    for extra in dense_dir.iterdir():
        if extra.name.startswith("tokenizer") or extra.suffix == ".jinja":
            shutil.copy(extra, quant / extra.name)
    return quant, deq
