"""Load checkpoint tensors into manylora's model by translated parameter name.

The design follows TensorRT-LLM's ``ModelWeightsLoader``: an internal parameter name is translated
section by section (split on ``.``) into one or more external checkpoint names, the tensor (or only
the tensor-parallel rank's slice of it) is read for each, and the list is post-processed into the
parameter (concatenated along dim 0 by default, or by the parameter's own ``weight_loader``).
A checkpoint whose projection is already fused (Phi-3's ``qkv_proj`` and ``gate_up_proj``)
holds the untranslated name instead of the parts: its rows are cut into the parts (each
rank's rows of each) as if they had been separate tensors.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from manylora.checkpoint.errors import CheckpointError, MissingWeightError
from manylora.checkpoint.gguf import GGUFCheckpoint

logger = logging.getLogger(__name__)

DEFAULT_KEY_DICT: dict[str, str | list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
# (format, index file, glob patterns), in order of preference.
_FORMATS = (
    ("safetensors", "model.safetensors.index.json", ("*.safetensors",)),
    ("pickle", "pytorch_model.bin.index.json", ("pytorch_model*.bin",)),
    ("pickle", None, ("*.pth",)),
)


@dataclass(frozen=True)
class TPSlice:
    """The part of one external (checkpoint) tensor that a tensor-parallel rank holds.

    A parameter carrying ``tp_slices`` (one ``TPSlice`` per external tensor its name
    translates to, in order) gets, for each, the range ``[start, stop)`` along ``dim``,
    zero-padded at the end to ``size`` along ``dim``; the parts are then concatenated
    along dim 0 (a packed projection) like whole tensors are. This covers what an even
    ``tp_dim`` split cannot: KV heads replicated over ranks (the rows of one head) and a
    vocabulary not divisible by the ranks (a padded shard).

    Attributes:
        dim: the dimension cut.
        start, stop: the range kept along ``dim``.
        full: the external tensor's size along ``dim``.
        size: the part's size in the parameter along ``dim`` (≥ ``stop - start``).

    Raises:
        ValueError: a range outside ``[0, full]`` or larger than ``size``.
    """

    dim: int
    start: int
    stop: int
    full: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop <= self.full or self.stop - self.start > self.size:
            raise ValueError(f"bad tensor-parallel slice {self}")

    def cut(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s range along ``dim`` (a whole external tensor), zero-padded to
        ``size``."""
        part = tensor.narrow(self.dim, self.start, self.stop - self.start)
        return self.pad(part)

    def pad(self, part: torch.Tensor) -> torch.Tensor:
        """``part`` (already cut) zero-padded at the end of ``dim`` to ``size``."""
        missing = self.size - part.shape[self.dim]
        if missing == 0:
            return part
        shape = list(part.shape)
        shape[self.dim] = missing
        return torch.cat([part, part.new_zeros(shape)], dim=self.dim)


def _packed_dim(tp_slices: Sequence[TPSlice]) -> int:
    """The one dimension a packed parameter's parts are cut and concatenated along (dim 0
    of a dense ``[out, in]`` weight; a quantized layout may pack along another)."""
    dims = {s.dim for s in tp_slices}
    if len(dims) != 1:
        raise ValueError(f"a packed parameter's parts must be cut along one dimension, got "
                         f"{tp_slices}")
    return dims.pop()


def full_shape(shape: Sequence[int], tp_slices: Sequence[TPSlice]) -> tuple[int, ...]:
    """The shape, on one rank, of a parameter whose rank-local shape is ``shape`` and whose
    parts are ``tp_slices``: each part's ``size`` along its ``dim`` becomes ``full`` (the
    parts lie one after the other along their common ``dim``).

    Raises:
        ValueError: several parts cut along different dimensions.
    """
    out = list(shape)
    dim = _packed_dim(tp_slices)
    out[dim] = sum(s.full for s in tp_slices)
    return tuple(out)


def shard_tensor(full: torch.Tensor, tp_slices: Sequence[TPSlice]) -> torch.Tensor:
    """A rank's shard of a whole parameter ``full`` (the ``tp_size`` 1 layout, packed parts
    one after the other along their common ``dim``): each part cut and padded by its
    ``TPSlice``, concatenated along that ``dim``.

    Raises:
        ValueError: parts cut along different dimensions, or ``full`` not of their total
            size.
    """
    if len(tp_slices) == 1:
        return tp_slices[0].cut(full)
    dim = _packed_dim(tp_slices)
    if full.shape[dim] != sum(s.full for s in tp_slices):
        raise ValueError(f"cannot cut a tensor of shape {tuple(full.shape)} into {tp_slices}")
    parts = full.split([s.full for s in tp_slices], dim=dim)
    return torch.cat([s.cut(p) for p, s in zip(parts, tp_slices, strict=True)], dim=dim)


class ModelWeightsLoader:
    """Reads a checkpoint directory (or one file) and loads tensors by translated name.

    Follows TensorRT-LLM's ModelWeightsLoader: keys are translated by sections, and tensors can be
    read as the contiguous slice of one tensor-parallel rank (safetensors reads only that slice).
    Formats, in order of preference: ``*.safetensors`` (single, or exactly the files of
    ``model.safetensors.index.json``), ``pytorch_model*.bin`` (single, or per
    ``pytorch_model.bin.index.json``), then ``*.pth``; or one ``.gguf`` file (llama.cpp's,
    read through :class:`~manylora.checkpoint.gguf.GGUFCheckpoint` under Hugging Face names,
    dequantized to float32 and only the rank's rows or block-aligned columns read). Other
    tensors keep the checkpoint's dtype.

    Args:
        model_dir: checkpoint directory, or a single ``.safetensors``/``.bin``/``.pth``/
            ``.gguf`` file.
        customized_key_dict: updates :data:`DEFAULT_KEY_DICT` (internal section -> external
            section, a dotted string, a list to multiply keys, or ``""`` to drop the section).

    Raises:
        CheckpointError: no weight files found, a file is corrupt/unreadable (a GGUF also: split,
            or of an architecture transformers cannot read), an index names a missing file,
            or one external key is in two files.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        customized_key_dict: Mapping[str, str | list[str]] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.key_dict: dict[str, str | list[str]] = dict(DEFAULT_KEY_DICT)
        self.key_dict.update(customized_key_dict or {})
        self.format, self.files = self._detect_format()
        self._handles: list[object] = []  # safe_open handles or pickled state dicts
        self._shard_map: dict[str, int] = {}  # external key -> index into files/_handles
        for idx, path in enumerate(self.files):
            handle = self._open(path)
            self._handles.append(handle)
            for key in handle.keys():
                if key in self._shard_map:
                    other = self.files[self._shard_map[key]]
                    raise CheckpointError(f"Key {key!r} is in both {other} and {path}")
                self._shard_map[key] = idx
        logger.info("Checkpoint %s: %s format, %d file(s), %d tensors", self.model_dir,
                    self.format, len(self.files), len(self._shard_map))

    def _detect_format(self) -> tuple[str, list[Path]]:
        path = self.model_dir
        if path.is_file():
            if path.suffix == ".safetensors":
                return "safetensors", [path]
            if path.suffix in (".bin", ".pth", ".pt"):
                return "pickle", [path]
            if path.suffix.lower() == ".gguf":
                return "gguf", [path]
            raise CheckpointError(f"{path} is not a .safetensors, .bin, .pth or .gguf weight "
                                  "file")
        if not path.is_dir():
            raise CheckpointError(f"Checkpoint {path} is neither a directory nor a file")
        for fmt, index_name, patterns in _FORMATS:
            index = path / index_name if index_name else None
            if index is not None and index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                    names = sorted(set(weight_map.values()))
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                    raise CheckpointError(f"Unreadable index file {index}: {e}") from e
                files = [path / name for name in names]
                missing = [str(f) for f in files if not f.is_file()]
                if missing:
                    raise CheckpointError(f"Index {index} refers to missing file(s): {missing}")
                return fmt, files
            files = sorted({f for p in patterns for f in path.glob(p) if f.is_file()})
            if files:
                return fmt, files
        looked = [p for _, _, patterns in _FORMATS for p in patterns]
        raise CheckpointError(f"No weight files in {path} (looked for {', '.join(looked)})")

    def _open(self, path: Path) -> object:
        if self.format == "gguf":

            return GGUFCheckpoint(path)
        if self.format == "safetensors":
            try:
                return safe_open(str(path), framework="pt")
            except Exception as e:  # SafetensorError, OSError, ...
                raise CheckpointError(f"Corrupt or unreadable safetensors file {path}: {e}") from e
        try:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception:  # e.g. legacy (non-zip) format cannot be mmapped
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=False)
        except Exception as e:  # UnpicklingError, RuntimeError (zip), EOFError, ...
            raise CheckpointError(f"Corrupt or unreadable weight file {path}: {e}") from e
        if not isinstance(state, Mapping):
            raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def keys(self) -> list[str]:
        """All external tensor keys of the checkpoint, sorted."""
        return sorted(self._shard_map)

    def translate(self, key: str) -> list[str]:
        """Translate an internal parameter name into external key(s), section by section.

        Each ``.``-separated section found in the key dict is replaced by its value; a list value
        multiplies the keys (ordered product), ``""`` drops the section, other sections stay.
        E.g. ``model.layers.0.self_attn.qkv_proj.weight`` -> the ``q_proj``, ``k_proj`` and
        ``v_proj`` keys, in that order.
        """
        choices = []
        for section in key.split("."):
            value = self.key_dict.get(section, section)
            choices.append(value if isinstance(value, list) else [value])
        return [".".join(p for p in combo if p) for combo in itertools.product(*choices)]

    def load_tensor(
        self, key: str, tp_size: int = 1, tp_dim: int | None = None, tp_rank: int = 0
    ) -> torch.Tensor | None:
        """Load the tensor of external ``key`` in its checkpoint dtype, on CPU.

        With ``tp_size > 1`` and ``tp_dim`` given, only rank ``tp_rank``'s contiguous slice along
        ``tp_dim`` is returned (shape ``dim // tp_size`` there; safetensors reads only that part).

        Returns:
            The tensor, or None if no checkpoint file has ``key``.

        Raises:
            CheckpointError: ``tp_dim`` is not divisible by ``tp_size``, or a bad ``tp_rank``.
        """
        idx = self._shard_map.get(key)
        if idx is None:
            return None
        handle = self._handles[idx]
        sliced = tp_size > 1 and tp_dim is not None
        if self.format in ("safetensors", "gguf"):
            if not sliced:
                return handle.get_tensor(key)
            view = handle.get_slice(key)
            shape = list(view.get_shape())
        else:
            tensor = handle[key]
            if not sliced:
                return tensor
            shape = list(tensor.shape)
        if not 0 <= tp_rank < tp_size:
            raise CheckpointError(f"tp_rank {tp_rank} is out of range for tp_size {tp_size}")
        ndim = len(shape)
        if not -ndim <= tp_dim < ndim or shape[tp_dim % ndim] % tp_size:
            raise CheckpointError(f"Cannot split {key!r} of shape {shape} along dim {tp_dim} "
                                  f"into {tp_size} tensor-parallel parts")
        dim = tp_dim % ndim
        size = shape[dim] // tp_size
        if self.format in ("safetensors", "gguf"):
            index = (slice(None),) * dim + (slice(tp_rank * size, (tp_rank + 1) * size),)
            return view[index].contiguous()
        return tensor.narrow(dim, tp_rank * size, size).contiguous()

    def load_part(self, key: str, part: TPSlice) -> torch.Tensor | None:
        """Load only ``part``'s range of external ``key`` (safetensors reads just those bytes),
        zero-padded to ``part.size``; checkpoint dtype, on CPU.

        Returns:
            The part, or None if no checkpoint file has ``key``.

        Raises:
            CheckpointError: ``key``'s size along ``part.dim`` is not ``part.full``.
        """
        idx = self._shard_map.get(key)
        if idx is None:
            return None
        handle = self._handles[idx]
        if self.format in ("safetensors", "gguf"):
            view = handle.get_slice(key)
            shape = list(view.get_shape())
        else:
            tensor = handle[key]
            shape = list(tensor.shape)
        if not -len(shape) <= part.dim < len(shape) or shape[part.dim] != part.full:
            raise CheckpointError(f"Cannot take rows [{part.start}, {part.stop}) of dim "
                                  f"{part.dim} of {key!r} of shape {shape}: expected size "
                                  f"{part.full} there")
        dim = part.dim % len(shape)
        if self.format in ("safetensors", "gguf"):
            index = (slice(None),) * dim + (slice(part.start, part.stop),)
            loaded = view[index].contiguous()
        else:
            loaded = tensor.narrow(dim, part.start, part.stop - part.start).contiguous()
        return part.pad(loaded)

    def fused_key(self, key: str) -> str | None:
        """The external name of internal ``key`` with its fusing sections kept (those the
        key dict maps to a list, e.g. ``qkv_proj``), when the checkpoint holds that tensor
        and none of the parts :meth:`translate` names: a checkpoint whose projection is
        already fused, rows of the parts in order (Phi-3's ``qkv_proj`` ``[q + k + v,
        hidden]`` and ``gate_up_proj`` ``[2 * intermediate, hidden]``). None otherwise."""
        sections, fused = [], False
        for section in key.split("."):
            value = self.key_dict.get(section, section)
            if isinstance(value, list):
                fused, value = True, section
            sections.append(value)
        name = ".".join(p for p in sections if p)
        if not fused or name not in self._shard_map:
            return None
        if any(k in self._shard_map for k in self.translate(key)):
            return None
        return name

    def load(
        self, key: str, tp_size: int = 1, tp_dim: int | None = None, tp_rank: int = 0
    ) -> list[torch.Tensor]:
        """Translate internal ``key`` and load each external tensor (or its TP slice), in order;
        a fused checkpoint tensor (:meth:`fused_key`) whole, as the one tensor.

        Raises:
            MissingWeightError: (a ``CheckpointError`` and ``KeyError``) naming the missing
                external key(s), the internal key and the checkpoint directory.
            CheckpointError: a fused tensor asked for an even tensor-parallel slice (its
                parts are cut by ``tp_slices`` only).
        """
        fused = self.fused_key(key)
        if fused is not None:
            if tp_size > 1 and tp_dim is not None:
                raise CheckpointError(f"{fused!r} is a fused tensor: parameter {key!r} needs "
                                      "tp_slices to take each part's rows")
            return [self.load_tensor(fused)]
        external = self.translate(key)
        tensors = [self.load_tensor(k, tp_size, tp_dim, tp_rank) for k in external]
        missing = [k for k, t in zip(external, tensors, strict=True) if t is None]
        if missing:
            raise MissingWeightError(f"Checkpoint {self.model_dir} has no {missing} "
                                     f"(needed for parameter {key!r})")
        return tensors

    def load_model(self, model: torch.nn.Module, tp_rank: int = 0, tp_size: int = 1) -> None:
        """Fill every parameter of ``model`` from the checkpoint, in place.

        For each ``name, param`` the tensors of :meth:`load` (sliced along ``param.tp_dim`` if
        set) go to ``param.weight_loader(param, tensors)`` when the parameter has one; otherwise
        they are concatenated along ``param.pack_dim`` (default 0: the rows of a dense
        ``[out, in]`` weight) and copied into ``param`` (converting dtype/device).
        A parameter with ``tp_slices`` (one ``TPSlice`` per external tensor, set by the
        model's tensor-parallel layers through their linear method's ``create_weights``)
        reads exactly those ranges instead (:meth:`load_part`) whatever ``tp_rank``/
        ``tp_size`` say: the slices already name the rank's rows. The parameters, their
        layout and their ``weight_loader`` are the linear method's: the loader only reads.
        A parameter gathered from many checkpoint tensors of names the key dict cannot
        express (the stacked experts of a mixture-of-experts block) has a
        ``checkpoint_loader(loader, param, name)`` instead, which reads them through
        :meth:`load_tensor` / :meth:`load_part` and fills ``param`` itself.

        Raises:
            MissingWeightError: a parameter's external key is not in the checkpoint.
            CheckpointError: the loaded shape differs from the parameter's shape, or a
                parameter has another number of ``tp_slices`` than external tensors.
        """
        params = list(model.named_parameters())
        with torch.no_grad():
            for name, param in tqdm(params, desc="Loading weights"):
                checkpoint_loader = getattr(param, "checkpoint_loader", None)
                if checkpoint_loader is not None:
                    checkpoint_loader(self, param, name)
                    continue
                tp_slices = getattr(param, "tp_slices", None)
                if tp_slices is not None:
                    tensors = self._load_parts(name, tp_slices)
                else:
                    tensors = self.load(name, tp_size, getattr(param, "tp_dim", None), tp_rank)
                weight_loader = getattr(param, "weight_loader", None)
                if weight_loader is not None:
                    weight_loader(param, tensors)
                    continue
                tensor = (torch.cat(tensors, dim=getattr(param, "pack_dim", 0))
                          if len(tensors) > 1 else tensors[0])
                if tensor.shape != param.shape:
                    raise CheckpointError(
                        f"Shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)} "
                        f"({', '.join(self.translate(name))}) vs parameter {tuple(param.shape)}"
                    )
                param.data.copy_(tensor)

    def _load_parts(self, key: str, tp_slices: Sequence[TPSlice]) -> list[torch.Tensor]:
        fused = self.fused_key(key) if len(tp_slices) > 1 else None
        if fused is not None:
            # the parts lie one after the other along dim 0 of the fused tensor
            total = sum(s.full for s in tp_slices)
            starts = itertools.accumulate((s.full for s in tp_slices), initial=0)
            return [self.load_part(fused, TPSlice(0, off + s.start, off + s.stop, total, s.size))
                    for off, s in zip(starts, tp_slices)]
        external = self.translate(key)
        if len(external) != len(tp_slices):
            raise CheckpointError(f"parameter {key!r} has {len(tp_slices)} tensor-parallel "
                                  f"slices for the {len(external)} tensors {external}")
        tensors = [self.load_part(k, part) for k, part in zip(external, tp_slices)]
        missing = [k for k, t in zip(external, tensors, strict=True) if t is None]
        if missing:
            raise MissingWeightError(f"Checkpoint {self.model_dir} has no {missing} "
                                     f"(needed for parameter {key!r})")
        return tensors
