"""TensorRT-LLM's LoRA tensor format, and a converter from PEFT adapters to it.

An adapter is two tensors (TensorRT-LLM's ``LoraConfig``, and the ``model.lora_weights.npy``
/ ``model.lora_config.npy`` files its ``examples/hf_lora_convert.py`` writes):

* ``weights [N, W]`` (or ``[1, N, W]``), float16, bfloat16 or float32: one row per
  (module, layer), ``A [D, Hi]`` flattened, then ``B [Ho, D]`` flattened (the LoRA scaling
  ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA, folded into B), then for DoRA the ``Ho``
  normalized scales ``m / ||W + BA||``; zeros pad every row to the longest.
* ``config [N, 3]`` (or ``[1, N, 3]``) int32 rows ``[module_id, layer_idx, D]``, or
  ``[N, 4]`` with an ``is_dora`` flag last.

Module ids are TensorRT-LLM's (``LoraModuleType``); for the LLaMA family ``q_proj`` → attn_q,
``k_proj`` → attn_k, ``v_proj`` → attn_v, ``o_proj`` → attn_dense, ``gate_proj`` →
mlp_h_to_4h, ``down_proj`` → mlp_4h_to_h and ``up_proj`` → mlp_gate; the fused attn_qkv
(rows of B ``[q; k; v]``) and mlp_gate_up (``[gate; up]``) become their component modules,
which share A and each take their rows of B. bfloat16 ``.npy`` files hold numpy's 2-byte void
dtype (``'|V2'``), as TensorRT-LLM writes them.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from manylora.config import LORA_TARGET_MODULES
from manylora.lora.adapter import (
    LoRAAdapter,
    LoRAAdapterError,
    LoRAWeights,
    all_finite,
    check_delta,
)
from manylora.lora.formats.files import open_regular
from manylora.lora.formats.peft import (
    AdapterTarget,
    PeftScaling,
    check_peft_pair,
    component_modules,
    dora_scale_from_magnitude,
    group_peft_tensors,
    read_peft_config,
    read_peft_tensors,
)
from manylora.lora.loader_pool import report_progress

WEIGHTS_FILE = "model.lora_weights.npy"
CONFIG_FILE = "model.lora_config.npy"
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
}
_BF16_NUMPY = np.dtype("V2")


class LoraModuleType(enum.IntEnum):
    """TensorRT-LLM's LoRA module ids (its ``LoraModuleType``); ``trtllm_name`` gives the
    name its ``--lora_target_modules`` uses, e.g. ``attn_q``."""

    ATTN_QKV = 0
    ATTN_Q = 1
    ATTN_K = 2
    ATTN_V = 3
    ATTN_DENSE = 4
    MLP_H_TO_4H = 5
    MLP_4H_TO_H = 6
    MLP_GATE = 7
    CROSS_ATTN_QKV = 8
    CROSS_ATTN_Q = 9
    CROSS_ATTN_K = 10
    CROSS_ATTN_V = 11
    CROSS_ATTN_DENSE = 12
    MOE_H_TO_4H = 13
    MOE_4H_TO_H = 14
    MOE_GATE = 15
    MOE_ROUTER = 16
    MLP_ROUTER = 17
    MLP_GATE_UP = 18

    @property
    def trtllm_name(self) -> str:
        """TensorRT-LLM's string name of the module, e.g. ``"attn_qkv"``."""
        return self.name.lower()

    @classmethod
    def from_trtllm_name(cls, name: str) -> LoraModuleType:
        """The module type of a TensorRT-LLM name such as ``"mlp_gate_up"``.

        Raises:
            ValueError: not one of TensorRT-LLM's module names.
        """
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"{name!r} is not a TensorRT-LLM LoRA module name "
                             f"({', '.join(m.trtllm_name for m in cls)})") from None


#: HF projection → TensorRT-LLM module (LLaMA family, as ``hf_lora_convert.py`` maps them).
HF_TO_TRTLLM: dict[str, LoraModuleType] = {
    "q_proj": LoraModuleType.ATTN_Q,
    "k_proj": LoraModuleType.ATTN_K,
    "v_proj": LoraModuleType.ATTN_V,
    "o_proj": LoraModuleType.ATTN_DENSE,
    "gate_proj": LoraModuleType.MLP_H_TO_4H,
    "down_proj": LoraModuleType.MLP_4H_TO_H,
    "up_proj": LoraModuleType.MLP_GATE,
    "qkv_proj": LoraModuleType.ATTN_QKV,
    "gate_up_proj": LoraModuleType.MLP_GATE_UP,
}

#: TensorRT-LLM module → the HF projections its rows of B stack, in order. Ids missing here
#: (cross attention, MoE, routers) have no layer in the models manylora serves.
TRTLLM_TO_HF: dict[LoraModuleType, tuple[str, ...]] = {
    mtype: component_modules(module) for module, mtype in HF_TO_TRTLLM.items()
}


def _as_tensor(x: Any, what: str, name: str) -> torch.Tensor:
    """A CPU torch view of a torch tensor or numpy array (numpy ``'|V2'`` read as bfloat16)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:  # torch.from_numpy warns on read-only arrays
            x = x.copy()
        if x.dtype.kind == "V" and x.dtype.itemsize == 2:
            return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
        if x.dtype.kind in "biuf":
            return torch.from_numpy(np.ascontiguousarray(x))
        raise LoRAAdapterError(f"adapter {name!r}: {what} has numpy dtype {x.dtype}, which "
                               "TensorRT-LLM's LoRA format does not use")
    raise LoRAAdapterError(f"adapter {name!r}: {what} must be a torch tensor or a numpy array, "
                           f"got {type(x).__name__}")


def _drop_batch_dim(t: torch.Tensor, what: str, form: str, name: str) -> torch.Tensor:
    """``[1, N, X]`` → ``[N, X]``; ``[N, X]`` as is; anything else is refused."""
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2:
        raise LoRAAdapterError(f"adapter {name!r}: {what} has shape {list(t.shape)}, not "
                               f"{form} or [1, {form[1:]}")
    return t


def _check_weights(weights: Any, name: str) -> torch.Tensor:
    w = _drop_batch_dim(_as_tensor(weights, "weights", name), "weights", "[N, W]", name)
    if w.dtype not in STORAGE_DTYPES.values():
        raise LoRAAdapterError(f"adapter {name!r}: weights have dtype {w.dtype}; TensorRT-LLM's "
                               "LoRA weights are float16, bfloat16 or float32")
    return w


def _config_shape(config: Any, name: str) -> torch.Tensor:
    """The config ``[N, 3|4]``, its shape and dtype checked (no value read)."""
    c = _drop_batch_dim(_as_tensor(config, "config", name), "config", "[N, 3]", name)
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
                target: AdapterTarget) -> tuple[LoraModuleType, tuple[str, ...]]:
    """The row's module type and its HF projections; checks the id and the target modules."""
    module_id = values[0]
    try:
        mtype = LoraModuleType(module_id)
    except ValueError:
        raise _row_error(name, i, values, f"unknown module id {module_id} (TensorRT-LLM's ids "
                         f"are 0..{max(LoraModuleType).value})") from None
    if mtype not in TRTLLM_TO_HF:
        raise _row_error(name, i, values, f"module id {module_id} ({mtype.trtllm_name}) has no "
                         "layer in this model (a LLaMA-family decoder)")
    parts = TRTLLM_TO_HF[mtype]
    missing = [p for p in parts if p not in target.target_modules]
    if missing:
        raise _row_error(name, i, values, f"{mtype.trtllm_name} adapts {', '.join(missing)}, "
                         f"but lora_target_modules is {list(target.target_modules)}")
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


def adapter_from_trtllm(lora_int_id: int, name: str, weights: Any, config: Any,
                        target: AdapterTarget) -> LoRAAdapter:
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

    Returns:
        A ``LoRAAdapter`` with A/B in ``target.dtype`` and DoRA scales in float32 (taken as
        they are: TensorRT-LLM's scales are already normalized), contiguous on the CPU; ranks
        may differ between rows. attn_qkv / mlp_gate_up rows become q/k/v (gate/up) modules
        that share A.

    Raises:
        LoRAAdapterError: naming the adapter, the row and the problem: weights and config of
            other shapes or row counts, a config with other than 3 or 4 columns or with
            non-integer values, an unknown module id or one with no layer in this model
            (8..17), a module outside ``lora_target_modules``, a layer index out of range, D
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
    most = target.num_layers * len(LORA_TARGET_MODULES)
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
    return LoRAAdapter(lora_int_id, name, modules)


def _pad_rows(rows: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Stack 1-D rows into ``[N, max length]`` of ``dtype``, zero padded."""
    out = torch.zeros(len(rows), max(r.shape[0] for r in rows), dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def _check_storage_dtype(dtype: torch.dtype) -> None:
    if dtype not in STORAGE_DTYPES.values():
        raise ValueError(f"storage dtype {dtype} is not one of TensorRT-LLM's LoRA weight "
                         f"dtypes ({', '.join(STORAGE_DTYPES)})")


def adapter_to_trtllm(adapter: LoRAAdapter,
                      dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """An adapter as TensorRT-LLM's ``LoraConfig`` tensors.

    Args:
        adapter: any loaded adapter (each module becomes its own row; nothing is fused).
        dtype: float16, bfloat16 or float32, the weights' storage dtype.

    Returns:
        ``(weights [N, W] in dtype, config [N, 3] int32)``, rows ordered by (layer, module id)
        and zero padded to the longest; with any DoRA module, config is ``[N, 4]`` and DoRA
        rows (``is_dora`` 1) end with their float32 scales cast to ``dtype``.

    Raises:
        ValueError: ``dtype`` is not a storage dtype.
        LoRAAdapterError: a module with no TensorRT-LLM id.
    """
    _check_storage_dtype(dtype)
    unknown = sorted({m for _, m in adapter.weights if m not in HF_TO_TRTLLM})
    if unknown:
        raise LoRAAdapterError(f"adapter {adapter.name!r}: modules {unknown} have no "
                               "TensorRT-LLM LoRA module id")
    keys = sorted(adapter.weights, key=lambda k: (k[0], HF_TO_TRTLLM[k[1]]))
    rows, config = [], []
    for layer, module in keys:
        w = adapter.weights[(layer, module)]
        rows.append(torch.cat([t.detach().cpu().reshape(-1).to(dtype) for t in w.tensors()]))
        config.append([int(HF_TO_TRTLLM[module]), layer, w.rank]
                      + ([int(w.dora_scale is not None)] if adapter.has_dora else []))
    return _pad_rows(rows, dtype), torch.tensor(config, dtype=torch.int32)


def _to_numpy(t: Any) -> np.ndarray:
    """torch or numpy → numpy; bfloat16 as TensorRT-LLM's ``'|V2'``."""
    if isinstance(t, np.ndarray):
        return t
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16_NUMPY)
    return t.numpy()


def write_trtllm_dir(path: str | os.PathLike, weights: Any, config: Any) -> Path:
    """Write ``model.lora_weights.npy`` and ``model.lora_config.npy`` as TensorRT-LLM's
    ``hf_lora_convert.py`` does: weights ``[1, N, W]`` in their dtype (bfloat16 as numpy
    ``'|V2'``), config ``[1, N, 3|4]`` int32.

    Args:
        path: the directory (created if missing).
        weights, config: ``[N, ...]`` or ``[1, N, ...]``, torch or numpy.

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: weights and config that are not 2-D or 3-D with a batch of 1.
    """
    out = Path(path)
    arrays = {}
    for fname, t in ((WEIGHTS_FILE, _to_numpy(weights)), (CONFIG_FILE, _to_numpy(config))):
        if t.ndim == 2:
            t = t[None]
        if t.ndim != 3 or t.shape[0] != 1:
            raise ValueError(f"{fname}: shape {list(t.shape)} is not [N, X] or [1, N, X]")
        arrays[fname] = t
    arrays[CONFIG_FILE] = arrays[CONFIG_FILE].astype(np.int32)
    out.mkdir(parents=True, exist_ok=True)
    for fname, t in arrays.items():
        np.save(out / fname, np.ascontiguousarray(t), allow_pickle=False)
    return out


def read_trtllm_dir(path: str | os.PathLike, name: str | None = None,
                    target: AdapterTarget | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read TensorRT-LLM's ``model.lora_weights.npy`` and ``model.lora_config.npy``.

    Each file's ``.npy`` header is checked against the file's size before its data is read
    (``np.load`` allocates what a header declares). With ``target``, the config is read
    first and of each weights row only the prefix its config row uses (``D x Hi + Ho x D``,
    ``+ Ho`` for DoRA) is read: rows padded to a large width cost what they hold.

    Args:
        path: the directory holding both files.
        name: the adapter's name, for error messages (default: the path).
        target: the base model the rows are for; None: every row is read whole.

    Returns:
        ``(weights, config)`` as CPU torch tensors, shapes as stored (usually ``[1, N, W]``
        and ``[1, N, 3|4]``; with ``target``, weights ``[N, w]``, ``w`` the widest prefix
        used); ``'|V2'`` weights come back as bfloat16.

    Raises:
        LoRAAdapterError: a missing or unreadable file, one that is not a regular file
            (refused without blocking), a header that declares more data than the file
            holds, an array of Python objects, or a file that changed while it was read.
    """
    path = Path(path)
    who = name if name is not None else str(path)
    out = {}
    for fname in (CONFIG_FILE, WEIGHTS_FILE):
        what = f"adapter {who!r}: {fname}"
        try:
            with open_regular(path / fname, what) as f:
                header = _NpyHeader.read(f, what)
                if fname == WEIGHTS_FILE and target is not None:
                    array = header.read_prefixes(f, _row_needs(out[CONFIG_FILE], target))
                else:
                    array = header.read_all(f)
        except FileNotFoundError:
            raise LoRAAdapterError(f"{what} is missing (TensorRT-LLM's LoRA format needs "
                                   f"{WEIGHTS_FILE} and {CONFIG_FILE})") from None
        except (OSError, ValueError, EOFError) as e:
            if isinstance(e, LoRAAdapterError):
                raise
            raise LoRAAdapterError(f"adapter {who!r}: cannot read {fname}: {e}") from None
        out[fname] = _as_tensor(array, fname, who)
    return out[WEIGHTS_FILE], out[CONFIG_FILE]


def _row_needs(config: torch.Tensor, target: AdapterTarget) -> list[int] | None:
    """Values of each weights row its config row uses (0 for a row the adapter will be
    refused for); None when the config's shape is not one ``adapter_from_trtllm`` takes or
    it has more rows than the model has (layer, module) pairs (nothing needs reading)."""
    if config.dim() == 3 and config.shape[0] == 1:
        config = config[0]
    if (config.dim() != 2 or config.shape[1] not in (3, 4) or config.dtype == torch.bool
            or config.is_complex()
            or config.shape[0] > target.num_layers * len(LORA_TARGET_MODULES)):
        return None
    if config.is_floating_point():
        if not bool((torch.isfinite(config) & (config == config.round())).all()):
            return None
        config = config.to(torch.int64)
    needs = []
    for values in config.tolist():
        try:
            parts = TRTLLM_TO_HF.get(LoraModuleType(values[0]))
        except ValueError:
            parts = None
        rank = values[2]
        if parts is None or not 1 <= rank <= target.max_lora_rank:
            needs.append(0)
            continue
        hi = target.module_shapes[parts[0]][0]
        ho = sum(target.module_shapes[p][1] for p in parts)
        needs.append(rank * hi + ho * rank + (ho if len(values) == 4 and values[3] == 1 else 0))
    return needs


@dataclass(frozen=True)
class _NpyHeader:
    """A ``.npy`` file's header, checked against the file's size."""

    shape: tuple[int, ...]
    fortran: bool
    dtype: np.dtype
    offset: int
    what: str

    @classmethod
    def read(cls, f, what: str) -> _NpyHeader:
        """Raises ``LoRAAdapterError``: not a ``.npy`` file of version 1 or 2, an object
        dtype (pickles are never loaded), or more data declared than the file holds."""
        size = os.fstat(f.fileno()).st_size
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise LoRAAdapterError(f"{what}: .npy format version {version} is not read (only "
                                   "1.0 and 2.0, which np.save writes)")
        if dtype.hasobject:
            raise LoRAAdapterError(f"{what}: it holds Python objects, which are never "
                                   "unpickled")
        offset = f.tell()
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > size:
            raise LoRAAdapterError(f"{what}: its header declares a {dtype} array of shape "
                                   f"{list(shape)} ({nbytes} bytes), but the file holds "
                                   f"{size - offset} bytes of data")
        return cls(tuple(shape), fortran, dtype, offset, what)

    def _pread(self, f, at: int, into: np.ndarray) -> None:
        view, done = memoryview(into).cast("B"), 0
        while done < len(view):
            got = os.preadv(f.fileno(), [view[done:]], self.offset + at + done)
            if got == 0:
                raise LoRAAdapterError(f"{self.what}: the file ended within its data (it "
                                       "changed while it was read)")
            done += got

    def read_all(self, f) -> np.ndarray:
        """The whole array."""
        out = np.empty(self.shape, dtype=self.dtype, order="F" if self.fortran else "C")
        if out.size:
            self._pread(f, 0, out.reshape(-1, order="A"))
        return out

    def read_prefixes(self, f, needs: list[int] | None) -> np.ndarray:
        """``[N, w]``: of each row of a C-order ``[N, W]`` / ``[1, N, W]`` array its first
        ``w = min(max(needs), W)`` values; the whole array for any other layout, or
        ``[N, 0]`` when ``needs`` is None (the adapter is refused on shapes alone)."""
        shape = self.shape[1:] if len(self.shape) == 3 and self.shape[0] == 1 else self.shape
        if self.fortran or len(shape) != 2:
            return self.read_all(f)
        rows, width = shape
        if needs is None or len(needs) != rows:
            return np.empty((rows, 0), dtype=self.dtype)
        w = min(max(needs, default=0), width)
        out = np.empty((rows, w), dtype=self.dtype)
        if w:
            for i in range(rows):
                self._pread(f, i * width * self.dtype.itemsize, out[i])
                report_progress()
        return out


class _BaseWeights:
    """The base projections' weights of an HF checkpoint (single or sharded safetensors,
    ``.bin``), read on demand: what DoRA's magnitudes are normalized against."""

    def __init__(self, model_dir: str | os.PathLike) -> None:
        from manylora.checkpoint.weights import CheckpointError, ModelWeightsLoader

        try:
            self._loader = ModelWeightsLoader(model_dir)
        except CheckpointError as e:
            raise LoRAAdapterError(f"base model {model_dir}: {e}") from e
        self.model_dir = model_dir

    def weight(self, layer: int, module: str) -> torch.Tensor:
        """``[out, in]`` of one projection; a fused module's parts concatenated (dim 0).

        Raises:
            LoRAAdapterError: the checkpoint has no such tensor.
        """
        parts = []
        for part in component_modules(module):
            block = "self_attn" if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"model.layers.{layer}.{block}.{part}.weight"
            t = self._loader.load_tensor(key)
            if t is None:
                raise LoRAAdapterError(f"base model {self.model_dir} has no {key!r} (needed to "
                                       "normalize the DoRA magnitudes)")
            parts.append(t)
        return torch.cat(parts)


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
    from manylora.lora.dora import dora_row_norm

    magnitude = magnitude.reshape(-1).float()
    weight = base.weight(layer, module_key.rsplit(".", 1)[-1])
    if magnitude.shape[0] != b.shape[0] or weight.shape != (b.shape[0], a.shape[1]):
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_A {tuple(a.shape)}, lora_B "
            f"{tuple(b.shape)} and lora_magnitude_vector {tuple(magnitude.shape)}, but the base "
            f"weight is {tuple(weight.shape)}: the adapter was trained for another base model")
    return dora_scale_from_magnitude(magnitude, dora_row_norm(weight, a, b),
                                     f"adapter {name!r}: {module_key}")


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
        LoRAAdapterError: what ``load_peft_adapter`` refuses without a base model (missing
            or corrupt files, unsupported config, unknown modules, missing A/B/magnitude,
            NaN/Inf); a module given fused and on its own; a DoRA adapter without
            ``base_model_dir``, or whose base weights are missing or of another shape.
    """
    _check_storage_dtype(storage_dtype)
    name = str(peft_dir)
    cfg = read_peft_config(peft_dir, name)
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
        check_peft_pair(name, module_key, ab, use_dora)
        module = module_key.rsplit(".", 1)[-1]
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
    weights = _pad_rows([r.to(storage_dtype) for r, _ in ordered], storage_dtype)
    config = torch.tensor([c for _, c in ordered], dtype=torch.int32)
    return weights[None], config[None]
