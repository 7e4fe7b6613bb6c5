"""``LoRARequest``: which adapter a request runs with; ``alora_start``, the first position an
activated adapter (aLoRA) applies to.

vLLM's type and field names (``lora_name``, ``lora_int_id``, ``lora_path``), extended with
TensorRT-LLM's ``LoraConfig`` (``task_id``, ``weights``, ``config``): an adapter is named
either by a path or by its tensors, and both land in the same adapter cache, keyed by
``lora_int_id`` (= ``task_id``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LoRARequest:
    """Names an adapter for a request.

    Three forms:

    * ``LoRARequest(name, id, path)``: a PEFT adapter directory, a directory holding
      TensorRT-LLM's ``model.lora_weights.npy`` / ``model.lora_config.npy``, or a hub id.
    * ``LoRARequest(task_id=id, weights=w, config=c)``: TensorRT-LLM's tensor format (see
      ``manylora.lora.formats.trtllm``); the first request for a task must carry both.
    * ``LoRARequest(task_id=id)`` (or ``LoRARequest(name, id)``): an adapter the engine
      already caches. One that is not cached (never seen, or evicted from the host cache
      when it has no path to reload from) is an error for that request alone.

    Attributes:
        lora_name: a human-readable name (reported in outputs and metrics); defaults to
            ``"task_<id>"``.
        lora_int_id: a unique integer ≥ 1; the adapter's identity in the host cache, the
            device slots and the scheduler. Two requests with the same id share one loaded
            copy.
        lora_path: see above; empty for the tensor form.
        base_model_name: optional; only reported.
        task_id: TensorRT-LLM's name for ``lora_int_id``; give one or both (equal).
        weights: ``[num_module_layers, D*Hi + Ho*D (+ Ho)]`` (or with a leading batch
            dimension of 1), a torch tensor or numpy array of float16, bfloat16 or float32.
        config: ``[num_module_layers, 3 or 4]`` integers ``[module_id, layer_idx, D(,
            is_dora)]``, torch or numpy.
        replace: let ``weights``/``config`` replace different weights cached under the same
            id (refused otherwise, and refused while requests still use the old weights).
        alora_invocation_tokens: makes an adapter in TensorRT-LLM's format (tensors, or a
            directory of its ``.npy`` files, which has no config of its own) an activated
            LoRA (aLoRA) with these invocation token ids (``alora_start``); a PEFT
            adapter's come from its ``adapter_config.json`` alone.

    Raises:
        ValueError: an id < 1, ``task_id`` and ``lora_int_id`` that differ, only one of
            ``weights`` and ``config``, both a path and tensors, or
            ``alora_invocation_tokens`` that are not a non-empty sequence of token ids.
    """

    lora_name: str = ""
    lora_int_id: int = 0
    lora_path: str = ""
    base_model_name: str | None = None
    task_id: int | None = None
    weights: Any = field(default=None, compare=False, repr=False)
    config: Any = field(default=None, compare=False, repr=False)
    replace: bool = False
    alora_invocation_tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.task_id is not None:
            if self.lora_int_id and self.lora_int_id != self.task_id:
                raise ValueError(f"task_id {self.task_id} and lora_int_id {self.lora_int_id} "
                                 "differ: they name the same thing, give one")
            object.__setattr__(self, "lora_int_id", self.task_id)
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id (task_id) must be an integer ≥ 1 (0 is the base "
                             f"model), got {self.lora_int_id!r}")
        if (self.weights is None) != (self.config is None):
            raise ValueError(f"LoRA request for task {self.lora_int_id}: weights and config "
                             "come together (TensorRT-LLM's LoraConfig), got only "
                             f"{'weights' if self.config is None else 'config'}")
        if self.weights is not None and self.lora_path:
            raise ValueError(f"LoRA request for task {self.lora_int_id} has both a lora_path "
                             "and weights/config: give one")
        if self.alora_invocation_tokens is not None:
            object.__setattr__(self, "alora_invocation_tokens", invocation_tokens(
                self.alora_invocation_tokens, f"LoRA request for task {self.lora_int_id}"))
        if not self.lora_name:
            object.__setattr__(self, "lora_name", f"task_{self.lora_int_id}")
        if self.task_id is None:
            object.__setattr__(self, "task_id", self.lora_int_id)

    @property
    def has_tensors(self) -> bool:
        """Whether the request carries the adapter's weights and config itself."""
        return self.weights is not None


#: ``alora_start`` of a prompt that lacks its adapter's invocation sequence: past every
#: position a request reaches, so no token of it gets the adapter's weights.
ALORA_NEVER = 1 << 62


def invocation_tokens(value: Any, what: str) -> tuple[int, ...]:
    """An activated adapter's invocation token ids (``alora_invocation_tokens``, from a
    request or a PEFT config) as a tuple.

    Raises:
        ValueError: not a non-empty sequence of non-negative ints (``what`` names whose).
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value \
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                       for t in value):
        raise ValueError(f"{what}: alora_invocation_tokens = {value!r} is not a non-empty "
                         "list of token ids")
    return tuple(value)


def alora_start(token_ids: list[int], invocation: tuple[int, ...] | None) -> int:
    """The first position an adapter's weights apply to in a request: 0 for a plain
    adapter; for an activated one (aLoRA, Greenewald et al. 2025; peft's
    ``calculate_alora_offsets``), the start of the last occurrence of its invocation
    sequence in the prompt ``token_ids``, or ``ALORA_NEVER`` when the prompt lacks it, so
    the request runs as the base model, as peft runs it. Tokens before the start get the
    base model's weights, so their keys and values are the base model's.
    """
    if invocation is None:
        return 0
    inv = list(invocation)
    n = len(inv)
    for start in range(len(token_ids) - n, -1, -1):
        if token_ids[start] == inv[0] and token_ids[start: start + n] == inv:
            return start
    return ALORA_NEVER
