"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``/``.bin``).

Follows peft's semantics: per module rank from ``rank_pattern`` and alpha from
``alpha_pattern`` (a key matches a module name ``m`` when ``m`` matches ``(.*\\.)?(key)$``,
as peft's ``get_pattern_key``), scaling ``alpha / r`` or, with ``use_rslora``,
``alpha / sqrt(r)``, folded into B once here (vLLM's ``optimize``).

Adapters trained on fused projections (``self_attn.qkv_proj``, ``mlp.gate_up_proj``, as
Phi-3-style checkpoints have them) are split into their component modules: each component
shares A and takes its rows of B (and of DoRA's magnitude), which computes the same delta.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from manylora.config import LORA_TARGET_MODULES
from manylora.lora.adapter import (
    LoRAAdapter,
    LoRAAdapterError,
    LoRAWeights,
    all_finite,
    check_delta,
)
from manylora.lora.formats.files import MAX_CONFIG_BYTES, is_present, open_regular, read_regular
from manylora.lora.formats.patterns import MatchBudget, PatternTable, compile_bounded
from manylora.lora.loader_pool import report_progress
from manylora.lora_request import LoRARequest

logger = logging.getLogger(__name__)

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.*?(?:^|\.)layers\.(?P<layer>\d+)\."
    r"(?:self_attn|mlp)\.(?P<name>\w+))\.(?:lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight"
    r"|lora_(?P<mag>magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?)$")
#: The module path of a decoder layer's projection, from ``layers.`` on.
_LAYER_PATH = re.compile(r"(?:^|\.)(layers\.\d+\.(?:self_attn|mlp)\.\w+)$")
_UNSUPPORTED_CONFIG = {
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
}

#: Fused projections an adapter may be trained on → the modules they stack (rows of B, in
#: order), as HF's ``qkv_proj`` ([q; k; v]) and ``gate_up_proj`` ([gate; up]) stack them.
FUSED_PEFT_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

#: ``{(layer, module path): {"A": lora_A, "B": lora_B, "M": magnitude}}`` of one adapter.
PeftPairs = dict[tuple[int, str], dict[str, torch.Tensor]]

#: The largest safetensors header read (bytes); an adapter's lists its few hundred tensors in
#: some 100 KB (safetensors itself allows 100 MB).
MAX_HEADER_BYTES = 16 << 20

#: safetensors' dtype names → torch dtypes (the ones a tensor of an adapter may have; the
#: integer ones are read only to be refused by name).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}

#: The longest regex ``target_modules`` accepted (characters; compiling holds the GIL).
MAX_TARGET_REGEX_CHARS = 2048

#: The projections of a decoder layer by block, as HF's LLaMA-family models name them (the
#: fused ones too), for matching a config's ``target_modules`` as peft matches it.
_BLOCK_MODULES = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")),
                  ("mlp", ("gate_proj", "up_proj", "down_proj", "gate_up_proj")))


@dataclass(frozen=True)
class AdapterTarget:
    """What an adapter must fit: the base model's projections and the slot limits.

    Attributes:
        module_shapes: ``{module: (in_features, out_features)}`` of the seven projections.
        num_layers: decoder layers in the base model.
        max_lora_rank: the padded rank of the slots.
        target_modules: projections that have slot buffers (``lora_target_modules``).
        dtype: the model dtype adapters are stored in.
        base_model_names: names the base model goes by (path, hub id); an adapter trained
            for another one gets a warning.
        dora_norm: ``(layer, module, a [r, in], b [out, r]) → float32 [out]``, the L2 norm of
            each output row of ``W + b @ a`` over the base weight ``W`` of that module (what
            DoRA's magnitude is normalized against); None: DoRA adapters are refused.
    """

    module_shapes: dict[str, tuple[int, int]]
    num_layers: int
    max_lora_rank: int
    target_modules: tuple[str, ...]
    dtype: torch.dtype
    base_model_names: tuple[str, ...] = ()
    dora_norm: Callable[[int, str, torch.Tensor, torch.Tensor], torch.Tensor] | None = field(
        default=None, compare=False, repr=False)


def component_modules(module: str) -> tuple[str, ...]:
    """The projections a PEFT module name stands for: itself, or a fused module's parts."""
    return FUSED_PEFT_MODULES.get(module, (module,))


def _check_config_types(cfg: dict, what: str) -> None:
    """The types PEFT's ``LoraConfig`` gives its fields: ``r`` a positive integer,
    ``lora_alpha`` a finite number, ``use_rslora`` / ``use_dora`` booleans,
    ``target_modules`` a list of strings, a string (a regex) or null."""
    r = cfg.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRAAdapterError(f"{what}: r = {r!r} is not a positive integer")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoRAAdapterError(f"{what}: lora_alpha = {alpha!r} is not a finite number")
    for key in ("use_rslora", "use_dora"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise LoRAAdapterError(f"{what}: {key} = {cfg[key]!r} is not true or false")
    targets = cfg.get("target_modules")
    if not (targets is None or isinstance(targets, str)
            or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise LoRAAdapterError(f"{what}: target_modules = {targets!r} is neither a list of "
                               "module names nor a regex string")


class PeftScaling:
    """peft's LoRA scaling of each module of one adapter: ``alpha / r``, or
    ``alpha / sqrt(r)`` with ``use_rslora``; alpha from ``alpha_pattern`` (else
    ``lora_alpha``), the expected rank from ``rank_pattern`` (else ``r``), matched as peft's
    ``get_pattern_key`` does with bounded work (``PatternTable``).

    Args:
        cfg: the adapter's config (``read_peft_config``: its types already checked).
        name: the adapter's name, for messages.

    Raises:
        LoRAAdapterError: a bad ``rank_pattern`` / ``alpha_pattern`` (see ``PatternTable``).
    """

    def __init__(self, cfg: dict, name: str, budget: MatchBudget | None = None) -> None:
        what = f"adapter {name!r}"
        budget = budget or MatchBudget()
        self.name = name
        self.alpha = cfg.get("lora_alpha", 8)
        self.r = cfg.get("r", 8)
        self.rslora = bool(cfg.get("use_rslora"))
        self.alphas = PatternTable("alpha_pattern", cfg.get("alpha_pattern"), what, budget)
        self.ranks = PatternTable("rank_pattern", cfg.get("rank_pattern"), what, budget)

    def check_keys(self, modules: Iterable[str]) -> None:
        """Refuse pattern keys that match none of ``modules`` (the modules the adapter
        targets; peft warns of such keys and ignores them).

        Raises:
            LoRAAdapterError: naming the keys, or the matching budget ran out.
        """
        modules = list(modules)
        for table in (self.ranks, self.alphas):
            unmatched = table.unmatched(modules)
            if unmatched:
                raise LoRAAdapterError(
                    f"adapter {self.name!r}: {table.field} keys {unmatched} match no module "
                    "the adapter targets in the base model")

    def check_ranks(self, max_lora_rank: int) -> None:
        """Refuse ``r`` or a ``rank_pattern`` rank above ``max_lora_rank`` (vLLM refuses
        ``r`` above it).

        Raises:
            LoRAAdapterError: naming the field and the rank.
        """
        if self.r > max_lora_rank:
            raise LoRAAdapterError(f"adapter {self.name!r}: r = {self.r} exceeds "
                                   f"max_lora_rank={max_lora_rank}")
        for key, rank in self.ranks.items():
            if rank > max_lora_rank:
                raise LoRAAdapterError(f"adapter {self.name!r}: rank_pattern[{key!r}] = {rank} "
                                       f"exceeds max_lora_rank={max_lora_rank}")

    def __call__(self, module_key: str, r: int) -> float:
        """The scaling of module ``module_key`` (e.g. ``model.layers.0.self_attn.q_proj``)
        whose stored rank is ``r`` (≥ 1); a rank that disagrees with the config's is logged
        and used.

        Raises:
            LoRAAdapterError: the pattern matching budget ran out.
        """
        alpha = self.alphas.value(module_key, self.alpha)
        expected_r = self.ranks.value(module_key, self.r)
        if int(expected_r) != r:
            logger.warning("adapter %r: %s has rank %d, its config says %d; using %d",
                           self.name, module_key, r, expected_r, r)
        return alpha / math.sqrt(r) if self.rslora else alpha / r


def read_peft_config(path: str | os.PathLike, name: str) -> dict:
    """Read and check a PEFT adapter's ``adapter_config.json`` (a regular file of at most
    ``MAX_CONFIG_BYTES``; a FIFO or device is refused without blocking).

    Returns:
        The config dict.

    Raises:
        LoRAAdapterError: a missing, unreadable or oversized file, one that is not a regular
            file, a config that is not PEFT LoRA, fields of the wrong type (``r``,
            ``lora_alpha``, ``use_rslora``, ``use_dora``, ``target_modules``),
            ``modules_to_save``, or a bias other than ``"none"`` (``name`` names the adapter).
    """
    what = f"adapter {name!r}"
    try:
        text = read_regular(Path(path) / "adapter_config.json", f"{what}: adapter_config.json",
                            MAX_CONFIG_BYTES)
    except FileNotFoundError as e:
        raise LoRAAdapterError(str(e)) from None
    try:
        cfg = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise LoRAAdapterError(f"{what}: cannot read adapter_config.json: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{what}: adapter_config.json is not a PEFT LoRA config")
    for key, why in _UNSUPPORTED_CONFIG.items():
        if cfg.get(key):
            raise LoRAAdapterError(f"{what}: {why}")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{what}: bias={cfg['bias']!r} is not supported "
                               "(only bias='none')")
    _check_config_types(cfg, what)
    return cfg


class PeftWeights:
    """The tensors of a PEFT adapter's weights file, their keys, dtypes and shapes known
    before any tensor is processed (from the safetensors header, before any data is read;
    an ``adapter_model.bin`` is read whole). A context manager that closes the file.

    Attributes:
        meta: ``{key: tensor on the meta device}``, each of the stored dtype and shape.
    """

    def __init__(self, meta: dict[str, torch.Tensor], read: Callable[[str], torch.Tensor],
                 stack: contextlib.ExitStack) -> None:
        self.meta, self._read, self._stack = meta, read, stack

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key`` on the CPU (only its bytes are read)."""
        return self._read(key)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> PeftWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fd_path(f, path: Path) -> str:
    """A name that opens the very file ``f`` has open (``/proc/self/fd``, so a file swapped
    under the adapter directory since it was checked is not read), else ``path``."""
    fd_dir = "/proc/self/fd"
    return f"{fd_dir}/{f.fileno()}" if os.path.isdir(fd_dir) else str(path)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _open_safetensors(f, path: Path, what: str, stack: contextlib.ExitStack) -> PeftWeights:
    """The header checked against the file's size, then validated by safetensors'
    ``safe_open`` (which maps the file without reading its data); each tensor's bytes are
    then read with ``pread`` from the file checked (not through a mapping: a file truncated
    while it is read is an error here, where a mapped page past its end would be SIGBUS)."""
    from safetensors import SafetensorError, safe_open

    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise LoRAAdapterError(f"{what}: no safetensors header ({size} bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
        raise LoRAAdapterError(f"{what}: its safetensors header claims {n} bytes, more than "
                               f"{MAX_HEADER_BYTES}")
    if 8 + n > size:
        raise LoRAAdapterError(f"{what}: its safetensors header claims {n} bytes, but the file "
                               f"holds {size}")
    header = f.read(n)
    end = _data_end(header)
    if end is not None and 8 + n + end > size:
        raise LoRAAdapterError(f"{what}: its safetensors header places tensor data up to byte "
                               f"{8 + n + end}, but the file holds {size} bytes")
    try:
        with safe_open(_fd_path(f, path), framework="pt"):
            pass                             # the header's own validation
    except SafetensorError as e:
        raise LoRAAdapterError(f"{what}: {_first_line(e)}") from None
    meta, places = {}, {}
    for key, entry in json.loads(header).items():
        if key == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise LoRAAdapterError(f"{what}: tensor {key!r} has dtype {entry['dtype']}, which "
                                   "no LoRA weight has")
        meta[key] = torch.empty(entry["shape"], dtype=dtype, device="meta")
        begin, stop = entry["data_offsets"]
        places[key] = (8 + n + begin, stop - begin)
    fd = f.fileno()

    def read(key: str) -> torch.Tensor:
        offset, nbytes = places[key]
        raw = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(raw.numpy()), 0
        while done < nbytes:
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as e:
                raise LoRAAdapterError(f"{what}: tensor {key!r}: {e.strerror or e}") from None
            if got == 0:
                raise LoRAAdapterError(f"{what}: the file ended within tensor {key!r}'s data "
                                       "(it changed while it was read)")
            done += got
        t = meta[key]
        return raw.view(t.dtype).reshape(t.shape)
    return PeftWeights(meta, read, stack)


def _data_end(header: bytes) -> int | None:
    """The largest end offset of tensor data a safetensors header names (bytes after the
    header); None when the header is not what safetensors writes (``safe_open`` says why)."""
    try:
        entries = json.loads(header)
    except (ValueError, RecursionError):
        return None
    if not isinstance(entries, dict):
        return None
    ends = [e["data_offsets"][1] for k, e in entries.items()
            if k != "__metadata__" and isinstance(e, dict)
            and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
            and isinstance(e["data_offsets"][1], int)]
    return max(ends, default=0)


def _open_bin(f, path: Path, what: str, stack: contextlib.ExitStack) -> PeftWeights:
    """``torch.load`` with ``weights_only``, as vLLM reads ``adapter_model.bin`` (read
    whole: a memory map would turn a file truncated while it is read into SIGBUS)."""
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise LoRAAdapterError(f"{what}: cannot read {path.name}: it holds Python objects "
                               "other than tensors, which are never unpickled "
                               "(weights_only)") from None
    except Exception as e:  # pickle and zip raise many types for a corrupt file
        raise LoRAAdapterError(f"{what}: cannot read {path.name}: {_first_line(e)}") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise LoRAAdapterError(f"{what}: {path.name} does not hold a dict of named tensors")
    return PeftWeights({k: _meta(v) for k, v in state.items()}, state.__getitem__, stack)


def open_peft_weights(path: str | os.PathLike, name: str) -> PeftWeights:
    """Open ``adapter_model.safetensors`` (or ``adapter_model.bin``) of a PEFT adapter, a
    regular file only, reading no more than a safetensors file's header: it must fit the
    file (``MAX_HEADER_BYTES`` at most, tensor data within the file's size, and safetensors'
    own validation). An ``adapter_model.bin`` (a pickle) is read whole.

    Raises:
        LoRAAdapterError: neither file exists, it is not a regular file, or its header is
            corrupt or does not fit the file (naming the problem).
    """
    path, what = Path(path), f"adapter {name!r}"
    for file in ("adapter_model.safetensors", "adapter_model.bin"):
        if not is_present(path / file):
            continue
        stack = contextlib.ExitStack()
        try:
            f = stack.enter_context(open_regular(path / file, f"{what}: {file}"))
            if file.endswith(".safetensors"):
                return _open_safetensors(f, path / file, f"{what}: cannot read {file}", stack)
            return _open_bin(f, path / file, what, stack)
        except BaseException:
            stack.close()
            raise
    raise LoRAAdapterError(f"{what}: no adapter_model.safetensors or adapter_model.bin")


def read_peft_tensors(path: str | os.PathLike, name: str) -> dict[str, torch.Tensor]:
    """Every tensor of a PEFT adapter's weights file (``open_peft_weights``).

    Returns:
        ``{key: tensor}`` as stored, on the CPU.

    Raises:
        LoRAAdapterError: as ``open_peft_weights``.
    """
    with open_peft_weights(path, name) as weights:
        return {key: weights.read(key) for key in weights.meta}


def _first_line(e: Exception) -> str:
    """An exception's message without torch's multi-line, ANSI-coloured hints."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_peft_config(path: str | os.PathLike, name: str, target: AdapterTarget) -> dict:
    """``read_peft_config`` and the checks a config alone allows cheaply (named target
    modules the model has, ``layers_to_transform`` / ``layers_pattern`` as ``peft_targets``
    without matching a regex ``target_modules``, ``rank_pattern`` / ``alpha_pattern`` keys
    that compile, ranks within ``max_lora_rank``): at most ``MAX_CONFIG_BYTES`` read, no
    tensor.

    Returns:
        The config dict.

    Raises:
        LoRAAdapterError: as ``read_peft_config``, a named target module the base model
            lacks, as ``peft_targets``, as ``PatternTable`` (a pattern key that does not
            compile, a value of the wrong type), or ``r`` / a ``rank_pattern`` rank above
            ``max_lora_rank``.
    """
    cfg = read_peft_config(path, name)
    _check_target_names(cfg, name, target)
    budget = MatchBudget()
    peft_targets(cfg, name, target.num_layers, budget, match_regex=False)
    PeftScaling(cfg, name, budget).check_ranks(target.max_lora_rank)
    return cfg


def _check_target_names(cfg: dict, name: str, target: AdapterTarget) -> None:
    targets = cfg.get("target_modules")
    if not isinstance(targets, list):
        return  # a regex or "all-linear": the tensors say what it targets
    for t in targets:
        module = t.rsplit(".", 1)[-1]
        if module not in LORA_TARGET_MODULES and module not in FUSED_PEFT_MODULES:
            raise LoRAAdapterError(
                f"adapter {name!r} targets module {t!r}, which the base model does not have "
                f"as a LoRA-targetable projection ({', '.join(LORA_TARGET_MODULES)})")


def model_module_names(num_layers: int) -> list[str]:
    """The names peft matches ``target_modules`` against for the base model's adaptable
    projections: ``model.layers.{i}.{self_attn|mlp}.{projection}`` (HF's LLaMA-family names,
    fused ``qkv_proj`` / ``gate_up_proj`` included)."""
    return [f"model.layers.{i}.{block}.{m}" for i in range(num_layers)
            for block, modules in _BLOCK_MODULES for m in modules]


def _layer_filter(cfg: dict, what: str, num_layers: int
                  ) -> tuple[set[int] | None, list[str] | None]:
    """``layers_to_transform`` (None: every layer) and ``layers_pattern`` (None: peft's
    default) of a config, checked as peft's ``LoraConfig`` checks them, every index within
    the base model."""
    layers, pattern = cfg.get("layers_to_transform"), cfg.get("layers_pattern")
    if isinstance(cfg.get("target_modules"), str) and (layers is not None
                                                       or pattern is not None):
        raise LoRAAdapterError(f"{what}: layers_to_transform / layers_pattern cannot be used "
                               "when target_modules is a regex string (as peft's LoraConfig)")
    if pattern and layers is None:
        raise LoRAAdapterError(f"{what}: layers_pattern needs layers_to_transform (as peft's "
                               "LoraConfig)")
    if pattern is not None and not (isinstance(pattern, str) or (
            isinstance(pattern, list) and all(isinstance(p, str) for p in pattern))):
        raise LoRAAdapterError(f"{what}: layers_pattern = {pattern!r} is neither a string nor "
                               "a list of strings")
    if layers is None:
        return None, None
    indexes = [layers] if isinstance(layers, int) else layers
    if not isinstance(indexes, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in indexes):
        raise LoRAAdapterError(f"{what}: layers_to_transform = {layers!r} is neither a layer "
                               "index nor a list of them")
    if not indexes:                          # peft: an empty list filters nothing
        return None, None
    missing = sorted({i for i in indexes if not 0 <= i < num_layers})
    if missing:
        raise LoRAAdapterError(f"{what}: layers_to_transform names layers {missing}, which the "
                               f"base model does not have (it has {num_layers} layers)")
    patterns = None if not pattern else [pattern] if isinstance(pattern, str) else pattern
    return set(indexes), patterns


def _layer_index(module: str, patterns: list[str] | None, compiled: dict,
                 budget: MatchBudget, what: str) -> int | None:
    """The layer index of ``module`` as peft's ``check_target_module_exists`` finds it."""
    if patterns is None:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        return None if m is None else int(m["idx"])
    for p in patterns:
        if p not in compiled:
            compiled[p] = compile_bounded(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.",
                                          f"{what}: layers_pattern {p!r}")
        m = budget.match(compiled[p], module, f"{what}: matching layers_pattern {p!r}")
        if m is not None:
            return int(m["idx"])
    return None


def peft_targets(cfg: dict, name: str, num_layers: int, budget: MatchBudget,
                 match_regex: bool = True) -> set[str] | None:
    """The base model's modules (``model_module_names``) an adapter's config targets, as
    peft's ``check_target_module_exists`` decides: a list of names matches a module named
    so or ending in ``.name``, then ``layers_to_transform`` (with ``layers_pattern``) keeps
    the modules of those layers; a string is a regex the whole name must match
    (``"all-linear"``: every projection).

    Args:
        cfg: the config (``read_peft_config``).
        name: the adapter's name, for messages.
        num_layers: decoder layers in the base model.
        budget: the adapter's regex matching budget.
        match_regex: False: a regex ``target_modules`` is compiled only (None returned).

    Returns:
        The targeted module names; None when the config names no ``target_modules`` (the
        tensors say what it targets) or, without ``match_regex``, a regex.

    Raises:
        LoRAAdapterError: what peft's ``inject_adapter`` refuses (no module matches:
            "Target modules ... not found in the base model", naming ``layers_to_transform``
            and ``layers_pattern`` when given) and ``LoraConfig`` refuses (layer options with
            a regex), an index of ``layers_to_transform`` past the model's layers, an invalid
            regex, or matching over the budget.
    """
    what = f"adapter {name!r}"
    targets = cfg.get("target_modules")
    layers, patterns = _layer_filter(cfg, what, num_layers)
    if targets is None:
        return None
    names = model_module_names(num_layers)
    if isinstance(targets, str):
        if targets.lower() == "all-linear":
            return set(names)
        if len(targets) > MAX_TARGET_REGEX_CHARS:
            raise LoRAAdapterError(f"{what}: the target_modules regex is {len(targets)} "
                                   f"characters long, more than {MAX_TARGET_REGEX_CHARS}")
        pattern = compile_bounded(targets, f"{what}: target_modules {targets!r}")
        if not match_regex:
            return None
        found = {n for n in names
                 if budget.match(pattern, n, f"{what}: matching target_modules {targets!r}",
                                 full=True)}
    else:
        wanted, compiled = set(targets), {}
        found = set()
        for n in names:
            parts = n.split(".")
            if not any(".".join(parts[i:]) in wanted for i in range(len(parts))):
                continue
            if layers is not None and _layer_index(n, patterns, compiled, budget,
                                                   what) not in layers:
                continue
            found.add(n)
    if not found:
        message = (f"{what}: target modules {targets!r} not found in the base model (as peft's "
                   "inject_adapter refuses)")
        if layers is not None:
            message += f"; layers_to_transform is {cfg['layers_to_transform']!r}"
        if patterns is not None:
            message += f", layers_pattern {cfg['layers_pattern']!r}"
        raise LoRAAdapterError(message)
    return found


def layer_path(module_key: str) -> str:
    """The name peft gives a tensor's module in the base model,
    ``model.layers.{i}.{block}.{projection}`` (``module_key`` from ``layers.`` on)."""
    m = _LAYER_PATH.search(module_key)
    return module_key if m is None else "model." + m[1]


def group_peft_tensors(tensors: dict[str, torch.Tensor], name: str) -> PeftPairs:
    """Group a PEFT state dict by ``(layer, module path)`` into ``{"A", "B", "M"}`` tensors
    (any values: the keys alone decide).

    The module path is the key without peft's ``base_model.model.`` prefix and suffixes,
    e.g. ``model.layers.0.self_attn.q_proj``; ``"M"`` is DoRA's ``lora_magnitude_vector``.

    Raises:
        LoRAAdapterError: a key that is not a decoder layer's LoRA tensor, or one whose
            projection is neither one of ``LORA_TARGET_MODULES`` nor a fused ``qkv_proj`` /
            ``gate_up_proj``.
    """
    pairs: PeftPairs = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(
                f"adapter {name!r}: tensor {key!r} targets a module manylora cannot adapt "
                f"(only {', '.join(LORA_TARGET_MODULES)} of the decoder layers)")
        if m["name"] not in LORA_TARGET_MODULES and m["name"] not in FUSED_PEFT_MODULES:
            raise LoRAAdapterError(
                f"adapter {name!r} targets module {m['module']!r}, which the base model does "
                "not have")
        pairs.setdefault((int(m["layer"]), m["module"]), {})[m["ab"] or "M"] = tensor
    return pairs


def check_peft_pair(name: str, module_key: str, ab: dict[str, torch.Tensor],
                    use_dora: bool) -> None:
    """Check that one module has both A and B, a magnitude exactly when the adapter is DoRA,
    floating-point tensors, 2-D A ``[r, in]`` and B ``[out, r]`` with ``r ≥ 1``, and only
    finite values (tensors on the meta device: all but the values).

    Raises:
        LoRAAdapterError: naming the adapter, the module and the problem.
    """
    if not {"A", "B"} <= set(ab):
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_{''.join(sorted(ab))} but not both "
            "A and B")
    for label, t in ab.items():
        if not t.is_floating_point():
            raise LoRAAdapterError(
                f"adapter {name!r}: {module_key} has {_tensor_name(label)} of dtype "
                f"{t.dtype}, not a floating-point dtype")
    a, b = ab["A"], ab["B"]
    if a.dim() != 2 or b.dim() != 2:
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}, not 2-D [r, in] and [out, r]")
    if a.shape[0] < 1 or b.shape[1] != a.shape[0]:
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}: their rank must agree and be at least 1")
    if use_dora != ("M" in ab):
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} " + (
                "has no lora_magnitude_vector, but the adapter is DoRA (use_dora)"
                if use_dora else "has a lora_magnitude_vector, but use_dora is not set"))
    for label, t in ab.items():
        if not t.is_meta and not all_finite(t):
            raise LoRAAdapterError(
                f"adapter {name!r}: {module_key} has NaN or Inf in {_tensor_name(label)}")


def _tensor_name(label: str) -> str:
    return "lora_magnitude_vector" if label == "M" else "lora_" + label


def _check_against_target(name: str, pairs: PeftPairs, target: AdapterTarget) -> None:
    for layer, module_key in pairs:
        module = module_key.rsplit(".", 1)[-1]
        for part in component_modules(module):
            if part not in target.target_modules:
                raise LoRAAdapterError(
                    f"adapter {name!r} targets {part}"
                    + (f" (through {module})" if part != module else "")
                    + f", but lora_target_modules is {list(target.target_modules)}")
        if layer >= target.num_layers:
            raise LoRAAdapterError(
                f"adapter {name!r} has weights for layer {layer}, but the base model has "
                f"{target.num_layers} layers")


def _split_rows(name: str, module_key: str, b: torch.Tensor, parts: tuple[str, ...],
                target: AdapterTarget) -> tuple[int, list[int]]:
    """Input width and per-component output widths of a (fused) module; checks B's height."""
    in_f = target.module_shapes[parts[0]][0]
    widths = [target.module_shapes[p][1] for p in parts]
    if len(parts) > 1 and b.dim() == 2 and b.shape[0] != sum(widths):
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_B {tuple(b.shape)}, but its rows must "
            f"stack {' + '.join(parts)} = {' + '.join(map(str, widths))} = {sum(widths)} "
            "outputs of the base model")
    return in_f, widths


def _check_shapes(name: str, module_key: str, ab: dict[str, torch.Tensor],
                  target: AdapterTarget) -> tuple[list[int], int]:
    """A and B (and DoRA's magnitude) of one module against its base projection and
    ``max_lora_rank`` (meta tensors will do); the component widths and the rank."""
    parts = component_modules(module_key.rsplit(".", 1)[-1])
    a, b = ab["A"], ab["B"]
    in_f, widths = _split_rows(name, module_key, b, parts, target)
    out_f = sum(widths)
    r = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape != (out_f, r):
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}, but the base projection needs [r, {in_f}] and "
            f"[{out_f}, r]: the adapter was trained for another base model")
    if r > target.max_lora_rank:
        raise LoRAAdapterError(
            f"adapter {name!r}: rank {r} of {module_key} exceeds max_lora_rank="
            f"{target.max_lora_rank}")
    if "M" in ab and ab["M"].numel() != out_f:
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_magnitude_vector "
            f"{tuple(ab['M'].shape)}, but the base projection has {out_f} outputs")
    return widths, r


def _module_weights(name: str, layer: int, module_key: str, ab: dict[str, torch.Tensor],
                    scaling: PeftScaling, target: AdapterTarget,
                    ) -> dict[tuple[int, str], LoRAWeights]:
    """One PEFT module (or fused module) → ``{(layer, module): LoRAWeights}``."""
    parts = component_modules(module_key.rsplit(".", 1)[-1])
    widths, r = _check_shapes(name, module_key, ab, target)
    a, b = ab["A"], ab["B"]
    a = a.to(target.dtype).contiguous()
    b = (b.float() * scaling(module_key, r)).to(target.dtype)
    check_delta(f"adapter {name!r}: {module_key}", a, b)
    magnitudes: tuple[torch.Tensor | None, ...] = (None,) * len(parts)
    if "M" in ab:
        magnitude = ab["M"].reshape(-1).float()
        magnitudes = magnitude.split(widths)
    out = {}
    for part, b_part, m_part in zip(parts, b.split(widths), magnitudes):
        b_part = b_part.contiguous()
        dora_scale = None if m_part is None else dora_scale_from_magnitude(
            m_part, target.dora_norm(layer, part, a, b_part),
            f"adapter {name!r}: {module_key}" + (f" ({part})" if len(parts) > 1 else ""))
        out[(layer, part)] = LoRAWeights(a, b_part, dora_scale)
    return out


def load_peft_adapter(request: LoRARequest, path: str | os.PathLike,
                      target: AdapterTarget) -> LoRAAdapter:
    """Load and validate a PEFT adapter into host memory.

    Fused ``qkv_proj`` / ``gate_up_proj`` modules are split into ``q_proj``/``k_proj``/
    ``v_proj`` (``gate_proj``/``up_proj``), which share A and each take their rows of B (and
    of the DoRA magnitude, normalized against that component's base weight).

    Args:
        request: the adapter's identity.
        path: a local directory holding ``adapter_config.json`` and the weights.
        target: the base model and slot limits the adapter must fit.

    Returns:
        A ``LoRAAdapter`` whose B matrices carry the scaling, in ``target.dtype`` on the CPU;
        for DoRA each module's ``dora_scale = m / ||W + BA||`` (peft's ``mag_norm_scale``).

    The weights file's structure (keys, dtypes, shapes, the A/B pairs, ranks, the modules
    the config targets) is checked from its header before any tensor data is read; then each
    module's tensors are read in turn.

    Raises:
        LoRAAdapterError: missing or corrupt files, a header that does not fit its file
            (``open_peft_weights``); ``modules_to_save``, embedding or bias LoRA; a module
            the model lacks or ``lora_target_modules`` excludes; a layer index past the
            model; targets, ``layers_to_transform`` / ``layers_pattern`` or ``rank_pattern``
            / ``alpha_pattern`` keys that match no module of the model (``peft_targets``,
            ``PeftScaling.check_keys``); weights for a module the config does not target;
            ``r`` or a ``rank_pattern`` rank above ``max_lora_rank``; A/B shapes that do
            not fit the base projection (for a fused module: a B whose height is not the
            sum of its components' widths); a module given both fused and on its own; a
            rank of 0 or above ``max_lora_rank``; NaN or Inf in a tensor; a delta whose
            size ``check_delta`` refuses; bad ``rank_pattern`` / ``alpha_pattern`` keys or
            values, or matching them over its time budget (``PatternTable``); a file that
            is not a regular file; a DoRA adapter (``use_dora``) without a magnitude for
            every module, or with no ``target.dora_norm`` to normalize it.
    """
    name, path = request.lora_name, Path(path)
    cfg = check_peft_config(path, name, target)
    base = cfg.get("base_model_name_or_path")
    if base and target.base_model_names and not _same_model(base, target.base_model_names):
        logger.warning("adapter %r was trained for base model %r, not %s", name, base,
                       " / ".join(target.base_model_names))
    use_dora = bool(cfg.get("use_dora"))
    if use_dora and target.dora_norm is None:
        raise LoRAAdapterError(f"adapter {name!r}: DoRA needs the base weights to normalize "
                               "its magnitudes, and none were given")
    budget = MatchBudget()
    targets = peft_targets(cfg, name, target.num_layers, budget)
    scaling = PeftScaling(cfg, name, budget)
    scaling.check_keys(sorted(targets) if targets is not None
                       else model_module_names(target.num_layers))
    weights: dict[tuple[int, str], LoRAWeights] = {}
    with open_peft_weights(path, name) as stored:
        # the structure, from the header alone: no tensor data is read before it passes
        keys = group_peft_tensors({k: k for k in stored.meta}, name)
        metas = {m: {label: stored.meta[k] for label, k in ab.items()}
                 for m, ab in keys.items()}
        _check_against_target(name, metas, target)
        _check_targeted(name, metas, targets)
        for (_, module_key), ab in sorted(metas.items()):
            check_peft_pair(name, module_key, ab, use_dora)
            _check_shapes(name, module_key, ab, target)
        report_progress()
        for (layer, module_key), ab in sorted(keys.items()):
            ab = {label: stored.read(k) for label, k in ab.items()}
            report_progress()
            check_peft_pair(name, module_key, ab, use_dora)
            for key, w in _module_weights(name, layer, module_key, ab, scaling,
                                          target).items():
                if key in weights:
                    raise LoRAAdapterError(
                        f"adapter {name!r}: layer {layer} has weights for {key[1]} twice (on "
                        "its own and through a fused qkv_proj / gate_up_proj)")
                weights[key] = w
    if not weights:
        raise LoRAAdapterError(f"adapter {name!r} holds no LoRA weights")
    return LoRAAdapter(request.lora_int_id, name, weights)


def _check_targeted(name: str, pairs: PeftPairs, targets: set[str] | None) -> None:
    """Every module with weights is one the config targets (peft would leave the weights of
    any other unused)."""
    if targets is None:
        return
    for _, module_key in sorted(pairs):
        if layer_path(module_key) not in targets:
            raise LoRAAdapterError(
                f"adapter {name!r} has weights for {module_key}, which its config's "
                "target_modules / layers_to_transform do not target (peft would not use them)")


def dora_scale_from_magnitude(magnitude: torch.Tensor, norm: torch.Tensor,
                              what: str) -> torch.Tensor:
    """DoRA's per-output scale ``m / ||W + BA||`` (float32 ``[out]``, on the CPU).

    Raises:
        LoRAAdapterError: a zero norm or a non-finite result (``what`` names the module).
    """
    scale = magnitude.float().cpu() / norm.float().cpu()
    if not all_finite(scale):
        raise LoRAAdapterError(f"{what}: the DoRA scale m / ||W + BA|| is not finite (a row "
                               "of the adapted weight has norm 0)")
    return scale.contiguous()


def _same_model(base: str, names: tuple[str, ...]) -> bool:
    def norm(s: str) -> str:
        return os.path.normpath(s.rstrip("/")) if s else s

    base_n = norm(base)
    for n in names:
        n_n = norm(n)
        if base_n == n_n or os.path.basename(base_n) == os.path.basename(n_n):
            return True
    return False
