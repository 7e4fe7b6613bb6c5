"""TensorRT-LLM's LoRA tensors ⇄ ``LoRAAdapter``.

An adapter is two tensors (TensorRT-LLM's ``LoraConfig``, and the ``model.lora_weights.npy``
/ ``model.lora_config.npy`` files its ``examples/hf_lora_convert.py`` writes):

* ``weights [N, W]`` (or ``[1, N, W]``), float16, bfloat16 or float32: one row per
  (module, layer), ``A [D, Hi]`` flattened, then ``B [Ho, D]`` flattened (the LoRA scaling
  ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA, folded into B), then for DoRA the ``Ho``
  normalized scales ``m / ||W + BA||``; zeros pad every row to the longest.
* ``config [N, 3]`` (or ``[1, N, 3]``) int32 rows ``[module_id, layer_idx, D]``, or
  ``[N, 4]`` with an ``is_dora`` flag last.

Module ids are TensorRT-LLM's (``trtllm_modules``); a fused attn_qkv or mlp_gate_up row
becomes its component modules, which share A and each take their rows of B. The MoE ids
(13..17) are read for a target whose ``module_shapes`` holds their modules: an expert row
(moe_h_to_4h, moe_4h_to_h, moe_gate) holds every expert, ``A [E, D, Hi]`` then
``B [E, Ho, D]`` flattened. The files holding the two tensors are ``trtllm_npy``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from manylora.config import LORA_EXPERT_MODULES, LORA_MOE_MODULES
from manylora.lora.adapter import (
    LoRAAdapter,
    LoRAAdapterError,
    LoRAWeights,
    all_finite,
    check_delta,
)
from manylora.lora.formats.target import AdapterTarget
from manylora.lora.formats.trtllm_modules import (
    HF_MOE_TO_TRTLLM,
    HF_TO_TRTLLM,
    LoraModuleType,
    max_rows,
    row_values,
    trtllm_parts,
)
from manylora.lora.formats.trtllm_npy import as_tensor
from manylora.lora.loader_pool import report_progress

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
}


def adapter_from_trtllm(lora_int_id: int, name: str, weights: Any, config: Any,
                        target: AdapterTarget,
                        invocation_tokens: tuple[int, ...] | None = None) -> LoRAAdapter:
    """Build an adapter from TensorRT-LLM's ``LoraConfig`` tensors.

    Args:
        lora_int_id, name: the adapter's identity (``task_id``, ``lora_name``).
        weights: ``[N, W]`` or ``[1, N, W]``, torch or numpy, float16, bfloat16 (numpy
            ``'|V2'`` too) or float32; each row ``A [D, Hi]``, ``B [Ho, D]`` (scaling folded
            in) flattened, then ``Ho`` normalized DoRA scales for an ``is_dora`` row, then
            padding (ignored).
        config: ``[N, 3|4]`` or ``[1, N, 3|4]`` integers ``[module_id, layer_idx, D(,
            is_dora)]``, torch or numpy.
        target: the base model and slot limits the adapter must fit.
        invocation_tokens: an activated LoRA's invocation token ids (the request's
            ``alora_invocation_tokens``: the format has no config to hold them), or None.

    Returns:
        A ``LoRAAdapter`` with A/B in ``target.dtype`` and DoRA scales in float32 (taken as
        they are: TensorRT-LLM's scales are already normalized), contiguous on the CPU; ranks
        may differ between rows. attn_qkv / mlp_gate_up rows become q/k/v (gate/up) modules
        that share A; expert rows ``experts.*`` with ``a [E, D, Hi]``, ``b [E, Ho, D]``; on
        a layer with a shared expert and no dense MLP, ids 5/6/7/18 the shared expert's.

    Raises:
        LoRAAdapterError: naming the adapter, the row and the problem: weights and config of
            other shapes or row counts, a config with other than 3 or 4 columns or with
            non-integer values, an unknown module id or one with no layer in this model
            (8..12; 13..17 when ``target.module_shapes`` lacks their module), a module
            outside ``lora_target_modules`` or on a layer that lacks it, DoRA on the
            experts, a layer index out of range, D
            outside ``1..max_lora_rank``, a row narrower than ``D*Hi + Ho*D (+ Ho)``, the same
            (module, layer) twice, NaN or Inf in the used part of a row, a row whose delta
            ``check_delta`` refuses (weights too large to compute with).
    """
    w, c = _check_weights(weights, name), _config_shape(config, name)
    if w.shape[0] != c.shape[0]:
        raise LoRAAdapterError(f"adapter {name!r}: weights have {w.shape[0]} rows but config "
                               f"has {c.shape[0]}; they describe the same (module, layer) rows")
    if w.shape[0] == 0:
        raise LoRAAdapterError(f"adapter {name!r}: weights and config hold no rows")
    most = max_rows(target)
    if w.shape[0] > most:
        raise LoRAAdapterError(f"adapter {name!r}: weights and config hold {w.shape[0]} rows, "
                               f"more than the {most} (module, layer) pairs of the base model")
    c = _check_config(c, name)
    modules: dict[tuple[int, str], LoRAWeights] = {}
    rows_of: dict[tuple[int, str], int] = {}
    for i, values in enumerate(c.tolist()):
        mtype, parts = _row_module(name, i, values, target)
        _check_row_config(name, i, values, target)
        layer = values[1]
        for part in parts:
            if (layer, part) in rows_of:
                raise _row_error(name, i, values, f"{part} of layer {layer} is already given by "
                                 f"row {rows_of[(layer, part)]}")
            rows_of[(layer, part)] = i
        for part, lw in _row_weights(name, i, values, w[i], parts, target).items():
            modules[(layer, part)] = lw
        report_progress()
    return LoRAAdapter(lora_int_id, name, modules, invocation_tokens=invocation_tokens)


def adapter_to_trtllm(adapter: LoRAAdapter,
                      dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """An adapter as TensorRT-LLM's ``LoraConfig`` tensors.

    Args:
        adapter: any loaded adapter (each module becomes its own row; nothing is fused; the
            stacked experts one row each, ``A [E, D, Hi]`` then ``B [E, Ho, D]``; the shared
            expert's projections the dense MLP's ids, as TensorRT-LLM's Qwen2-MoE).
        dtype: float16, bfloat16 or float32, the weights' storage dtype.

    Returns:
        ``(weights [N, W] in dtype, config [N, 3] int32)``, rows ordered by (layer, module id)
        and zero padded to the longest; with any DoRA module, config is ``[N, 4]`` and DoRA
        rows (``is_dora`` 1) end with their float32 scales cast to ``dtype``.

    Raises:
        ValueError: ``dtype`` is not a storage dtype.
        LoRAAdapterError: a module with no TensorRT-LLM id.
    """
    check_storage_dtype(dtype)
    ids = {**HF_TO_TRTLLM, **HF_MOE_TO_TRTLLM}
    unknown = sorted({m for _, m in adapter.weights if m not in ids})
    if unknown:
        raise LoRAAdapterError(f"adapter {adapter.name!r}: modules {unknown} have no "
                               "TensorRT-LLM LoRA module id")
    keys = sorted(adapter.weights, key=lambda k: (k[0], ids[k[1]]))
    rows, config = [], []
    for layer, module in keys:
        w = adapter.weights[(layer, module)]
        rows.append(torch.cat([t.detach().cpu().reshape(-1).to(dtype) for t in w.tensors()]))
        config.append([int(ids[module]), layer, w.rank]
                      + ([int(w.dora_scale is not None)] if adapter.has_dora else []))
    return pad_rows(rows, dtype), torch.tensor(config, dtype=torch.int32)


def _drop_batch_dim(t: torch.Tensor, what: str, form: str, name: str) -> torch.Tensor:
    """``[1, N, X]`` → ``[N, X]``; ``[N, X]`` as is; anything else is refused."""
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2:
        raise LoRAAdapterError(f"adapter {name!r}: {what} has shape {list(t.shape)}, not "
                               f"{form} or [1, {form[1:]}")
    return t


def _check_weights(weights: Any, name: str) -> torch.Tensor:
    w = _drop_batch_dim(as_tensor(weights, "weights", name), "weights", "[N, W]", name)
    if w.dtype not in STORAGE_DTYPES.values():
        raise LoRAAdapterError(f"adapter {name!r}: weights have dtype {w.dtype}; TensorRT-LLM's "
                               "LoRA weights are float16, bfloat16 or float32")
    return w


def _config_shape(config: Any, name: str) -> torch.Tensor:
    """The config ``[N, 3|4]``, its shape and dtype checked (no value read)."""
    c = _drop_batch_dim(as_tensor(config, "config", name), "config", "[N, 3]", name)
    if c.shape[1] not in (3, 4):
        raise LoRAAdapterError(
            f"adapter {name!r}: config has {c.shape[1]} columns; TensorRT-LLM's LoRA config "
            "rows are [module_id, layer_idx, D] or [module_id, layer_idx, D, is_dora]")
    if c.dtype == torch.bool or c.is_complex():
        raise LoRAAdapterError(f"adapter {name!r}: config has dtype {c.dtype}, not integers")
    return c


def _check_config(c: torch.Tensor, name: str) -> torch.Tensor:
    """The config's values, integers (as int64)."""
    if c.is_floating_point():
        bad = (~torch.isfinite(c) | (c != c.round())).any(dim=1).nonzero()
        if len(bad):
            i = int(bad[0])
            raise LoRAAdapterError(f"adapter {name!r}: config row {i} {c[i].tolist()} holds "
                                   "non-integer values")
    return c.to(torch.int64)


def _row_error(name: str, i: int, values: Sequence[int], problem: str) -> LoRAAdapterError:
    cols = "[module_id, layer_idx, D" + (", is_dora]" if len(values) == 4 else "]")
    return LoRAAdapterError(f"adapter {name!r}: row {i} ({cols} = {list(values)}): {problem}")


def _row_module(name: str, i: int, values: Sequence[int],
                target: AdapterTarget | None) -> tuple[LoraModuleType, tuple[str, ...]]:
    """The row's module type and its modules (``trtllm_parts``); checks the id, the target
    modules and that the row's layer has them."""
    module_id = values[0]
    try:
        mtype = LoraModuleType(module_id)
    except ValueError:
        raise _row_error(name, i, values, f"unknown module id {module_id} (TensorRT-LLM's ids "
                         f"are 0..{max(LoraModuleType).value})") from None
    parts = trtllm_parts(mtype, values[1], target)
    if parts is None:
        raise _row_error(name, i, values, f"module id {module_id} ({mtype.trtllm_name}) has no "
                         "layer in this model (a LLaMA-family decoder)")
    missing = [p for p in parts if p not in target.target_modules]
    if missing:
        hint = (f"; start the engine with {', '.join(missing)} in --lora-target-modules"
                if any(p in LORA_MOE_MODULES for p in missing) else "")
        raise _row_error(name, i, values, f"{mtype.trtllm_name} adapts {', '.join(missing)}, "
                         f"but lora_target_modules is {list(target.target_modules)}{hint}")
    for p in parts:
        if not target.layer_has(values[1], p):
            raise _row_error(name, i, values, f"{mtype.trtllm_name} adapts {p}, which layer "
                             f"{values[1]} of the base model does not have")
    return mtype, parts


def _check_row_config(name: str, i: int, values: Sequence[int], target: AdapterTarget) -> None:
    _, layer, rank = values[:3]
    if not 0 <= layer < target.num_layers:
        raise _row_error(name, i, values, f"layer index {layer} is out of range (the base "
                         f"model has {target.num_layers} layers)")
    if not 1 <= rank <= target.max_lora_rank:
        raise _row_error(name, i, values, f"adapter size D={rank} is not in 1..max_lora_rank="
                         f"{target.max_lora_rank}")
    if len(values) == 4 and values[3] not in (0, 1):
        raise _row_error(name, i, values, f"is_dora is {values[3]}, not 0 or 1")


def _row_weights(name: str, i: int, values: Sequence[int], row: torch.Tensor,
                 parts: tuple[str, ...], target: AdapterTarget) -> dict[str, LoRAWeights]:
    """One row → ``{module: LoRAWeights}`` of its component modules (shared A, rows of B)."""
    rank, is_dora = values[2], len(values) == 4 and values[3] == 1
    hi = target.module_shapes[parts[0]][0]
    widths = [target.module_shapes[p][1] for p in parts]
    ho = sum(widths)
    if parts[0] in LORA_EXPERT_MODULES:
        return {parts[0]: _expert_row(name, i, values, row, parts[0], target)}
    n_lora = rank * hi + ho * rank
    need = n_lora + (ho if is_dora else 0)
    if row.shape[0] < need:
        raise _row_error(name, i, values, f"the row holds {row.shape[0]} values, but D x Hi + "
                         f"Ho x D{' + Ho' if is_dora else ''} = {need} (Hi={hi}, Ho={ho})")
    if not all_finite(row[:n_lora]):
        raise _row_error(name, i, values, "NaN or Inf in its in/out weights")
    # copies: the adapter must not alias (or keep alive) the caller's weights tensor
    a = row[: rank * hi].reshape(rank, hi).to(target.dtype, copy=True).contiguous()
    b = row[rank * hi: n_lora].reshape(ho, rank).to(target.dtype, copy=True)
    check_delta(f"adapter {name!r}: row {i}", a, b)
    scales: Sequence[torch.Tensor | None] = [None] * len(parts)
    if is_dora:
        dora = row[n_lora: need].to(torch.float32, copy=True)
        if not all_finite(dora):
            raise _row_error(name, i, values, "its DoRA scales are not all finite")
        scales = dora.split(widths)
    return {p: LoRAWeights(a, bp.contiguous(), None if s is None else s.contiguous())
            for p, bp, s in zip(parts, b.split(widths), scales)}


def _expert_row(name: str, i: int, values: Sequence[int], row: torch.Tensor, module: str,
                target: AdapterTarget) -> LoRAWeights:
    """A moe_h_to_4h / moe_4h_to_h / moe_gate row: ``A [E, D, Hi]`` then ``B [E, Ho, D]``
    (every expert, expert-major), as TensorRT-LLM's ``LoraManager.load_from_hf`` stacks
    them; DoRA is refused, as TensorRT-LLM refuses it on the experts."""
    rank, n = values[2], target.num_experts
    hi, ho = target.module_shapes[module]
    if len(values) == 4 and values[3] == 1:
        raise _row_error(name, i, values, f"DoRA on the experts ({module}) is not supported "
                         "(nor by TensorRT-LLM)")
    n_a, need = n * rank * hi, row_values((module,), rank, target)
    if row.shape[0] < need:
        raise _row_error(name, i, values, f"the row holds {row.shape[0]} values, but E x (D x "
                         f"Hi + Ho x D) = {need} (E={n}, Hi={hi}, Ho={ho})")
    if not all_finite(row[:need]):
        raise _row_error(name, i, values, "NaN or Inf in its in/out weights")
    a = row[:n_a].reshape(n, rank, hi).to(target.dtype, copy=True).contiguous()
    b = row[n_a:need].reshape(n, ho, rank).to(target.dtype, copy=True).contiguous()
    check_delta(f"adapter {name!r}: row {i}", a, b)
    return LoRAWeights(a, b)


def pad_rows(rows: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Stack 1-D rows into ``[N, max length]`` of ``dtype``, zero padded."""
    out = torch.zeros(len(rows), max(r.shape[0] for r in rows), dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def check_storage_dtype(dtype: torch.dtype) -> None:
    if dtype not in STORAGE_DTYPES.values():
        raise ValueError(f"storage dtype {dtype} is not one of TensorRT-LLM's LoRA weight "
                         f"dtypes ({', '.join(STORAGE_DTYPES)})")
