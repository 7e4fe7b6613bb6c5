"""GGUF checkpoints (llama.cpp's single-file format) read through the ``gguf`` package and
transformers' own GGUF support, as vLLM takes them: the model path is the ``.gguf`` file.

The config and tokenizer are transformers' (``from_pretrained(folder, gguf_file=name)``);
:class:`GGUFCheckpoint` serves the tensors under Hugging Face names with safetensors'
``safe_open`` interface, dequantized to float32 by ``gguf.dequantize`` and with llama.cpp's
Q/K row permutation undone by transformers' tensor processor for the architecture, so every
value equals transformers' ``load_gguf_checkpoint``.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from manylora.checkpoint.errors import CheckpointError

_SUFFIX = ".gguf"


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file (an existing file whose name ends in ``.gguf``)."""
    p = Path(path)
    return p.suffix.lower() == _SUFFIX and p.is_file()


#: A file name's quantization suffix in llama.cpp's naming (``.Q4_1``, ``-Q4_K_M``,
#: ``.IQ2_XS``, ``-f16``, ``.BF16``).
_TYPE_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def gguf_model_names(path: str | os.PathLike) -> tuple[str, ...]:
    """Names of the model a GGUF file holds, for matching an adapter's
    ``base_model_name_or_path``: the file name without ``.gguf`` and without its
    quantization suffix (``SmolLM2-135M-Instruct.Q4_1.gguf`` → ``SmolLM2-135M-Instruct``),
    when it has one; otherwise none."""
    stem = Path(path).name.removesuffix(_SUFFIX)
    bare = _TYPE_SUFFIX.sub("", stem)
    return (bare,) if bare and bare != stem else ()


@functools.lru_cache(maxsize=4)
def _reader(path: Path) -> Any:
    """``gguf.GGUFReader`` of ``path`` (memory-mapped), cached: a GGUF's header and tokenizer
    arrays take seconds to parse.

    Raises:
        CheckpointError: the file is unreadable or not a GGUF, or is one part of a split GGUF.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # ValueError (bad magic/version), OSError, struct errors, ...
        raise CheckpointError(f"Corrupt or unreadable GGUF file {path}: {e}") from e
    count = _field(reader, "split.count")  # llama.cpp's LLM_KV_SPLIT_COUNT
    if count is not None and int(count) > 1:
        raise CheckpointError(
            f"{path} is one of {int(count)} parts of a split GGUF: merge them into one file "
            "first (llama.cpp's `llama-gguf-split --merge FIRST_PART OUT.gguf`)")
    return reader


def _field(reader: Any, key: str) -> Any:
    """A scalar or string metadata value of ``reader``, or None."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value[0]


def gguf_architecture(path: str | os.PathLike) -> str:
    """The file's ``general.architecture`` (llama.cpp's name: ``llama``, ``qwen2``, ...).

    Raises:
        CheckpointError: an unreadable, split or architecture-less GGUF.
    """
    reader = _reader(Path(path))
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise CheckpointError(f"GGUF file {path} has no general.architecture")
    return arch


@functools.lru_cache(maxsize=4)
def _config(path: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    arch = gguf_architecture(path)
    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name,
                                          trust_remote_code=trust_remote_code)
    except Exception as e:  # ValueError (architecture not supported), OSError, KeyError, ...
        raise CheckpointError(f"transformers cannot read the config of the GGUF file {path} "
                              f"(architecture {arch!r}): {e}") from e


def gguf_config(path: str | os.PathLike, trust_remote_code: bool = False) -> Any:
    """The ``PretrainedConfig`` that transformers builds from the GGUF metadata
    (``AutoConfig.from_pretrained(folder, gguf_file=name)``), cached per path.

    ``architectures`` may be None there; ``model_type`` is set (``mistral`` for a llama.cpp
    ``llama`` file named Mistral, as transformers reads it).

    Raises:
        CheckpointError: an unreadable, corrupt or split GGUF, or one whose architecture
            transformers cannot read (the message names the file and the architecture).
    """
    return _config(Path(path).resolve(), trust_remote_code)


def load_gguf_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False) -> Any:
    """The tokenizer (with the file's ``chat_template``) transformers builds from the GGUF
    (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``).

    Raises:
        CheckpointError: transformers cannot build a tokenizer from the file.
    """
    from transformers import AutoTokenizer

    p = Path(path).resolve()
    gguf_architecture(p)
    try:
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name,
                                             trust_remote_code=trust_remote_code)
    except Exception as e:  # ValueError, KeyError, NotImplementedError, ...
        raise CheckpointError(f"transformers cannot read the tokenizer of the GGUF file {p}: "
                              f"{e}") from e


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False,
                   use_fast: bool = True) -> Any:
    """A model's Hugging Face tokenizer: ``AutoTokenizer`` of a checkpoint folder (transformers'
    fast one where there is one, unless ``use_fast`` is False), or of a GGUF file
    (:func:`load_gguf_tokenizer`).

    Raises:
        OSError, ValueError: the tokenizer cannot be read (CheckpointError for a GGUF).
    """
    if is_gguf(path):
        return load_gguf_tokenizer(path, trust_remote_code)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                         use_fast=use_fast)


class _Slice:
    """``safe_open(...).get_slice(key)``'s object for one GGUF tensor."""

    def __init__(self, ckpt: GGUFCheckpoint, key: str) -> None:
        self._ckpt, self._key = ckpt, key

    def get_shape(self) -> list[int]:
        return list(self._ckpt.shape(self._key))

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._ckpt.read(self._key, index)


class GGUFCheckpoint:
    """One GGUF file with safetensors' ``safe_open`` interface under Hugging Face names.

    Names come from a meta-device transformers model of the file's config (its
    ``state_dict`` keys), each mapped to llama.cpp's name by the ``gguf`` package's
    ``get_tensor_name_map`` for the file's architecture (as transformers'
    ``get_gguf_hf_weights_map`` does); tensors the file lacks (a tied ``lm_head``) are not
    listed. Values are float32 CPU tensors of the Hugging Face shape (``[out, in]``):
    ``gguf.dequantize`` of the stored blocks, then transformers' tensor processor for the
    architecture (``TENSOR_PROCESSORS``: llama's undoes llama.cpp's Q/K row permutation),
    bit-identical to ``load_gguf_checkpoint(..., return_tensors=True)``.

    ``get_slice(key)[index]`` (``index`` a tuple of slices, at most one of them not whole)
    dequantizes only rows ``[start, stop)`` for a cut along dim 0 (for Q/K when the cut is
    whole heads, the permutation is undone per head); a cut along dim 1 reads only its
    bytes when both ends fall on the type's block boundary
    (``gguf.GGML_QUANT_SIZES[type][0]`` columns), else the tensor is dequantized whole and
    cut.

    Args:
        path: the ``.gguf`` file.

    Raises:
        CheckpointError: an unreadable, corrupt or split file, an architecture transformers
            cannot read, or (on reading) a tensor type ``gguf`` cannot dequantize.
    """

    def __init__(self, path: str | os.PathLike, trust_remote_code: bool = False) -> None:
        import gguf
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.path = Path(path).resolve()
        reader = _reader(self.path)
        self.config = gguf_config(self.path, trust_remote_code)
        arch = gguf_architecture(self.path)
        arch_id = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
        if arch_id is None:
            raise CheckpointError(f"GGUF file {self.path}: the gguf package does not know "
                                  f"the architecture {arch!r}")
        self._processor_cls = TENSOR_PROCESSORS.get(arch, TensorProcessor)
        self._config_dict = self.config.to_dict()
        self._plain = self._processor_cls in (TENSOR_PROCESSORS.get("llama"), TensorProcessor)
        name_map = gguf.get_tensor_name_map(arch_id, self.config.num_hidden_layers)
        try:
            with torch.device("meta"):
                hf_model = AutoModelForCausalLM.from_config(self.config)
        except Exception as e:  # ValueError: no causal-LM class for the config
            raise CheckpointError(f"GGUF file {self.path} (architecture {arch!r}): "
                                  f"transformers has no causal LM for it: {e}") from e
        stored = {t.name: t for t in reader.tensors}
        self._tensors: dict[str, Any] = {}
        for hf_name in hf_model.state_dict():
            base, dot, suffix = hf_name.rpartition(".")
            if suffix not in ("weight", "bias"):
                base, dot, suffix = hf_name, "", ""
            gguf_name = name_map.get_name(base)
            if gguf_name is None:
                continue
            tensor = stored.get(f"{gguf_name}{dot}{suffix}")
            if tensor is not None:
                self._tensors[hf_name] = tensor
        heads = self.config.num_attention_heads
        self._head_dim = (getattr(self.config, "head_dim", None)
                          or self.config.hidden_size // heads)

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def keys(self) -> list[str]:
        """The Hugging Face names of the file's tensors, sorted."""
        return sorted(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        """``key``'s Hugging Face shape (GGUF stores it reversed: ``[in, out]``)."""
        return tuple(int(n) for n in reversed(self._tensors[key].shape))

    def get_tensor(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``, float32 on CPU.

        Raises:
            KeyError: no such tensor. CheckpointError: a type ``gguf`` cannot dequantize.
        """
        return self.read(key, ())

    def get_slice(self, key: str) -> _Slice:
        """A lazy view of ``key``: ``get_shape()`` and ``[index]`` (safetensors' slice)."""
        if key not in self._tensors:
            raise KeyError(key)
        return _Slice(self, key)

    def read(self, key: str, index: Any) -> torch.Tensor:
        """``key[index]`` as a float32 CPU tensor; ``index`` is a slice or a tuple of slices
        (step 1) with at most one of them not whole.

        Raises:
            KeyError: no such tensor. ValueError: another kind of index.
            CheckpointError: a type ``gguf`` cannot dequantize.
        """
        tensor = self._tensors[key]
        shape = self.shape(key)
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
            raise ValueError(f"GGUF tensor {key!r} of shape {list(shape)}: unsupported "
                             f"index {index!r}")
        cuts = []
        for dim, s in enumerate(index):
            start, stop, step = s.indices(shape[dim])
            if step != 1:
                raise ValueError(f"GGUF tensor {key!r}: slices need step 1, got {s!r}")
            if (start, stop) != (0, shape[dim]):
                cuts.append((dim, start, max(start, stop)))
        if len(cuts) > 1:
            raise ValueError(f"GGUF tensor {key!r}: at most one dimension can be cut, got "
                             f"{index!r}")
        if not cuts:
            return self._finish(self._process(key, self._dequantize(key, tensor.data)))
        dim, start, stop = cuts[0]
        if dim == 0 and len(shape) == 2 and self._rows_alone(key, start, stop):
            rows = self._dequantize(key, tensor.data[start:stop])
            return self._finish(self._process(key, rows, (stop - start) // self._head_dim))
        if dim == 1 and len(shape) == 2 and not self._permuted(key):
            columns = self._column_bytes(tensor, shape[1], start, stop)
            if columns is not None:
                return self._finish(self._dequantize(key, tensor.data[:, columns]))
        whole = self._process(key, self._dequantize(key, tensor.data))
        return self._finish(np.take(whole, np.arange(start, stop), axis=dim))

    def _permuted(self, key: str) -> bool:
        return key.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias"))

    def _rows_alone(self, key: str, start: int, stop: int) -> bool:
        """Whether rows ``[start, stop)`` can be dequantized and processed on their own."""
        if not self._plain:
            return False
        if not self._permuted(key):
            return True
        return start % self._head_dim == 0 and stop % self._head_dim == 0

    def _column_bytes(self, tensor: Any, columns: int, start: int, stop: int) -> slice | None:
        """The stored units (bytes of blocks, or elements) of columns ``[start, stop)``, or
        None when a cut falls inside a quantization block."""
        import gguf

        block = gguf.GGML_QUANT_SIZES[tensor.tensor_type][0]
        if start % block or stop % block:
            return None
        per_block = tensor.data.shape[-1] // (columns // block)
        return slice(start // block * per_block, stop // block * per_block)

    def _dequantize(self, key: str, data: np.ndarray) -> np.ndarray:
        import gguf

        qtype = self._tensors[key].tensor_type
        try:
            return gguf.dequantize(data, qtype)
        except NotImplementedError as e:
            raise CheckpointError(f"GGUF file {self.path}: tensor {self._tensors[key].name} "
                                  f"({key}) is of type {qtype.name}, which the gguf package "
                                  f"cannot dequantize") from e

    def _process(self, key: str, weights: np.ndarray, heads: int | None = None) -> np.ndarray:
        """transformers' tensor processor on ``weights`` (``heads``: the heads a row cut of
        Q/K holds, for the per-head permutation)."""
        config = self._config_dict
        if heads is not None and self._permuted(key):
            config = {**config, "num_attention_heads": heads, "num_key_value_heads": heads}
        name = self._tensors[key].name
        return self._processor_cls(config=config).process(weights=weights, name=name).weights

    @staticmethod
    def _finish(weights: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))
