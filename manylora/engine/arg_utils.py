"""``EngineArgs``: every knob of the engine in one place, turned into per-component configs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from manylora.config import (
    KV_CACHE_DTYPES,
    LORA_DTYPE_NAMES,
    LORA_TARGET_MODULES,
    check_fairness,
)
from manylora.structured.bad_words import DEFAULT_MAX_BAD_WORDS
from manylora.structured.compiler import (
    DEFAULT_GRAMMAR_CACHE_BYTES,
    DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS,
)
from manylora.structured.grammar import DEFAULT_MAX_SPEC_BYTES
from manylora.structured_params import StructuredOutputsConfig


@dataclass
class EngineArgs:
    """The arguments of ``LLM(...)`` and ``manylora generate`` (vLLM's names).

    Attributes:
        model: a checkpoint directory or a Hugging Face hub id.
        tokenizer: tokenizer directory or id; defaults to ``model``.
        dtype: ``"auto"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        max_loras: device adapter slots = distinct adapters per step.
        max_lora_rank: rank every adapter slot is padded to.
        max_cpu_loras: adapters kept in host memory; None means max(32, max_loras).
        lora_target_modules: modules that get adapter slot buffers; None means the seven
            projections (``embed_tokens``, ``lm_head`` and the MoE block's modules,
            ``LORA_MOE_MODULES``, only when named).
        enable_lora: allocate adapter slots and accept LoRA requests.
        max_num_seqs: requests in the running batch.
        max_num_batched_tokens: tokens computed per step.
        block_size: tokens per KV cache block.
        num_kv_blocks: KV cache blocks; None sizes the cache from free memory.
        gpu_memory_utilization: share of GPU memory the engine may use (weights, adapter slots, KV).
        max_model_len: longest prompt + output; None means the model's limit.
        key_dict: extra checkpoint key translations (TensorRT-LLM's customized_key_dict).
        revision: hub revision for ``model``.
        download_dir: the Hugging Face hub cache directory hub models are downloaded to
            and read from (vLLM's ``--download-dir``); None: huggingface_hub's
            (``HF_HUB_CACHE``).
        tokenizer_mode: ``"auto"`` (transformers' fast tokenizer where there is one) or
            ``"slow"`` (``use_fast=False``), vLLM's modes; its others (``mistral``,
            ``custom``) are refused.
        seed: the engine's global random seed (vLLM's ``--seed``): Python's, NumPy's and
            torch's generators are seeded with it when the engine starts, so the sampling
            of requests without a ``seed`` repeats from one start to the next for the same
            requests in the same order (seeded requests draw from their own generators
            either way); None: not seeded.
        trust_remote_code: passed to transformers for config and tokenizer.
        load_format: ``"auto"`` (read the checkpoint) or ``"dummy"`` (random weights of the
            checkpoint's shapes; config.json is still read), for benchmarks.
        quantization: the base weights' format (vLLM's ``--quantization``): None or
            ``"auto"`` reads the checkpoint's ``quantization_config`` (FP8, GPTQ, AWQ or
            compressed-tensors); ``"fp8"`` on a 16-bit checkpoint quantizes its linear layers
            to FP8 as they load (per-channel weight scales, dynamic per-token activation
            scales); a format name on a checkpoint of another is refused.
        skip_tokenizer_init: load no tokenizer; prompts must be token ids and outputs carry
            token ids with empty text (stop strings are refused).
        enforce_eager: never replay steps as CUDA graphs (decode or piecewise).
        piecewise_cuda_graph_sizes: token buckets of the steps that are not decode-only (a
            prefill chunk, or prefill and decode mixed), replayed as piecewise CUDA graphs
            (the model between attention calls; attention eager); a step is padded to the
            smallest bucket that holds it, larger steps run eagerly. None: the default
            buckets (16 to 512 tokens, capped by ``max_num_batched_tokens``) on one GPU, off
            under tensor parallelism and on the CPU; empty: off. Explicit sizes on the CPU
            pad the steps and run the pieces eagerly (no graphs there), which is what the
            CPU tests exercise.
        max_cpu_lora_bytes: bytes of adapter tensors the host cache may hold (pinned memory
            on CUDA); None: bounded by ``max_cpu_loras`` only.
        lora_device_cache_percent: size the device slots as this share (0, 1] of the GPU
            memory left free after the weights and the KV cache are placed (TensorRT-LLM's
            ``device_cache_percent``); replaces ``max_loras``.
        lora_aging_steps: steps a waiting request may be passed over for requests whose
            adapters are resident before it takes the next free adapter slot in arrival order.
        enable_prefix_caching: reuse the KV of a cached prompt prefix computed under the
            same adapter weights (or the base model) instead of prefilling it again.
        swap_space: GiB of host memory (pinned on CUDA) that preempted requests' and evicted
            sessions' KV blocks may be copied to when that is cheaper than recomputing them;
            0: always recompute.
        kv_cache_dtype: ``"auto"`` (the model dtype), ``"int8"`` or ``"fp8_e4m3"``
            (quantized per token and KV head; about twice the tokens in the same memory).
        tensor_parallel_size: ranks the base weights, adapters and KV heads are split over,
            one process each (rank 0 is the engine's; NCCL on CUDA, gloo on CPU); on CUDA
            rank r uses GPU r.
        fully_sharded_loras: under tensor parallelism, also split the half of each adapter
            that is otherwise whole on every rank (A of column-parallel projections, B of
            row-parallel ones), at the cost of one more collective per column-parallel
            projection and two more per row-parallel one (vLLM's option; at rank 16 on two
            H200s it made decode steps slower: BENCHMARKS.md).
        async_scheduling: schedule and launch step n+1 before step n's sampled tokens reach
            the host (vLLM's async scheduling): the next step's decode inputs come from the
            sampled tokens on the device, so the host's planning and output handling overlap
            the GPU. Greedy and seeded outputs are the same on and off; a request that stops
            (EOS, stop id) computes one more token, which is discarded.
        lora_load_timeout: seconds one adapter read from disk (parse, validate, digest,
            pin; from the moment a loader thread starts it) may go without progress (a
            module read); a read stuck longer fails alone (its requests end with the error,
            a run-time load answers 504) and its loader thread is replaced. None: no bound.
        scheduling_policy: ``fair``: share the running batch between client groups (the
            requests one HTTP request or one ``LLM.generate`` call fans out to): waiting
            requests join least-running group first, and a group over ``max_group_share``
            gives up its newest requests to other groups' waiting ones when the batch is
            full; ``fcfs``: strict arrival order (vLLM's default).
        max_group_share: the share (0, 1] of max_num_seqs one client group keeps while
            other groups wait, under the fair policy; 1: never preempt for fairness.
        lora_dtype: ``"auto"`` (the model's dtype), ``"float16"``, ``"bfloat16"`` or
            ``"float32"``: the dtype of the adapter slots and of the LoRA shrink/expand
            operands (vLLM's); the model's or float32 (the delta computed in float32 and
            rounded once to the model's dtype).
        max_grammar_compile_seconds: the longest one grammar's compile may run, seconds;
            past it its requests alone end with an error naming the ``structured_outputs``
            kind and this flag. xgrammar cannot stop a compile under way: its thread ends it
            and drops the result, and is replaced so other grammars keep compiling. None
            (from Python only): no bound.
        grammar_cache_bytes: bytes of compiled grammars kept for reuse (xgrammar's
            ``memory_size_bytes`` of each, plus its spec), least recently used out first
            (vLLM's ``VLLM_XGRAMMAR_CACHE_MB``, 512 MiB).
        max_structured_output_spec_bytes: the most UTF-8 bytes of one request's output
            constraint: its JSON schema, regex, EBNF grammar, structural tag, ``choice``
            (as the grammar it becomes), the tools' schema of a required or named tool
            choice, or its ``bad_words`` together; larger ones are refused (400 naming the
            field) before anything is compiled or tokenized.
        max_bad_words: the most ``bad_words`` one request may carry (vLLM has no bound; each
            word costs two tokenizations and a place in the per-step ban index).
        structured_outputs_config: vLLM's server-wide structured-output options, a JSON
            object (``StructuredOutputsConfig``): ``backend`` (``auto`` or ``xgrammar``),
            ``disable_any_whitespace`` (JSON without optional whitespace, for every
            request), ``disable_additional_properties``, ``disable_fallback`` (accepted:
            one backend); other keys are refused, named.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    lora_target_modules: tuple[str, ...] | None = None
    enable_lora: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    key_dict: Mapping[str, str | list[str]] = field(default_factory=dict)
    revision: str | None = None
    download_dir: str | None = None
    tokenizer_mode: str = "auto"
    seed: int | None = None
    trust_remote_code: bool = False
    load_format: str = "auto"
    quantization: str | None = None
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False
    piecewise_cuda_graph_sizes: tuple[int, ...] | None = None
    max_cpu_lora_bytes: int | None = None
    lora_device_cache_percent: float | None = None
    lora_aging_steps: int = 64
    enable_prefix_caching: bool = True
    swap_space: float = 0.0
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    fully_sharded_loras: bool = False
    async_scheduling: bool = True
    lora_load_timeout: float | None = 60.0
    scheduling_policy: str = "fair"
    max_group_share: float = 0.5
    lora_dtype: str = "auto"
    max_grammar_compile_seconds: float | None = DEFAULT_MAX_GRAMMAR_COMPILE_SECONDS
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    max_structured_output_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES
    max_bad_words: int = DEFAULT_MAX_BAD_WORDS
    structured_outputs_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_cpu_loras is None:
            self.max_cpu_loras = max(32, self.max_loras)
        self.lora_target_modules = tuple(self.lora_target_modules or LORA_TARGET_MODULES)
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be ≥ 0 GiB, got {self.swap_space}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.piecewise_cuda_graph_sizes is not None:
            self.piecewise_cuda_graph_sizes = tuple(int(n) for n in
                                                    self.piecewise_cuda_graph_sizes)
            if any(n < 1 for n in self.piecewise_cuda_graph_sizes):
                raise ValueError("piecewise_cuda_graph_sizes must be positive token counts, "
                                 f"got {self.piecewise_cuda_graph_sizes}")
        if self.lora_load_timeout is not None and not self.lora_load_timeout > 0:
            raise ValueError(f"lora_load_timeout must be > 0 seconds, got "
                             f"{self.lora_load_timeout}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be ≥ 1, got {self.tensor_parallel_size}")
        check_fairness(self.scheduling_policy, self.max_group_share)
        if self.lora_dtype not in LORA_DTYPE_NAMES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPE_NAMES)}, got "
                             f"{self.lora_dtype!r}")
        if (self.max_grammar_compile_seconds is not None
                and not self.max_grammar_compile_seconds > 0):
            raise ValueError("max_grammar_compile_seconds must be > 0 seconds, got "
                             f"{self.max_grammar_compile_seconds}")
        for name in ("grammar_cache_bytes", "max_structured_output_spec_bytes",
                     "max_bad_words"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be ≥ 0, got {getattr(self, name)}")
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode {self.tokenizer_mode!r} is not supported: "
                             "manylora loads transformers' tokenizers, fast ('auto') or "
                             "slow ('slow')")
        StructuredOutputsConfig.parse(self.structured_outputs_config)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one flag per field (``max_loras`` → ``--max-loras``; booleans get
        ``--x`` / ``--no-x``; ``key_dict`` takes JSON), with the help text of the field's
        entry under "Attributes" above; vLLM's engine arguments."""
        helps = _attribute_help(cls.__doc__ or "")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = None if f.default is dataclasses.MISSING else f.default
            kwargs: dict = {"dest": f.name, "help": helps.get(f.name)}
            kind = str(f.type)
            if kind == "bool":
                kwargs.update(action=argparse.BooleanOptionalAction, default=default)
            elif kind.startswith("tuple[int"):
                kwargs.update(nargs="*", type=int, default=default)
            elif kind.startswith("tuple"):
                kwargs.update(nargs="+", default=default)
            elif kind.startswith("Mapping"):
                kwargs.update(type=_json_object, default=None, metavar="JSON")
            else:
                kwargs.update(type=_SCALARS[kind.split(" |")[0]], default=default)
            if f.name == "model":
                kwargs["required"] = True
            parser.add_argument(flag, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The ``EngineArgs`` of parsed flags (those ``add_cli_args`` added).

        Raises:
            ValueError: an invalid value (see ``__post_init__``).
        """
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if hasattr(args, f.name)}
        for name in ("key_dict", "structured_outputs_config"):
            if values.get(name) is None:
                values.pop(name, None)
        for name in ("lora_target_modules", "piecewise_cuda_graph_sizes"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values)


#: The ``tokenizer_mode`` values manylora takes (vLLM's names): transformers' ``use_fast``.
TOKENIZER_MODES = ("auto", "slow")

_SCALARS = {"str": str, "int": int, "float": float}


def _json_object(text: str) -> dict:
    """A JSON-object flag's value (``--key-dict``, ``--structured-outputs-config``).

    Raises:
        argparse.ArgumentTypeError: not JSON, or not an object (argparse names the flag).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def _attribute_help(doc: str) -> dict[str, str]:
    """``{field: help}`` from a Google-style "Attributes:" section."""
    section = doc.split("Attributes:", 1)[-1]
    entries = re.findall(r"^\s{8}(\w+): (.*?)(?=^\s{8}\w+: |\Z)", section, re.M | re.S)
    return {name: " ".join(text.split()).replace("%", "%%") for name, text in entries}
