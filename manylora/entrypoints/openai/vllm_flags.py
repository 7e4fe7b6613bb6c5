"""vLLM's ``vllm serve`` flags that ``manylora serve`` has no flag of its own for: one table,
each accepted by the parser and either a no-op (one INFO line when given) or refused with
the reason when given a value that would change what the server does. ``--config`` (a YAML
file of flags, read as vLLM's ``FlexibleArgumentParser`` reads it) and the short aliases of
flags manylora has (``-tp``, ``-q``) are here too.

The flags manylora honours are its own (``EngineArgs``, ``serve_args.py``, ``frontend_args.py``);
this table holds what is left, so that a vLLM launch line starts or fails with a reason,
never with argparse's ``unrecognized arguments``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

__all__ = ["VLLM_FLAGS", "VllmArgumentParser", "VllmFlag", "add_vllm_flags",
           "check_vllm_flags", "expand_config_file"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag manylora has no flag of its own for.

    Attributes:
        names: its option strings, the long one first (vLLM's short aliases after).
        kind: ``"bool"`` (``--x`` / ``--no-x``), ``"int"``, ``"float"``, ``"str"`` or
            ``"list"`` (one or more strings).
        reason: what manylora does instead, said in the log line or the refusal.
        allowed: under ``refuse``, the values taken as no-ops (vLLM's default, and values
            that describe what manylora always does); any other value is refused.
            ``None``: every value is a no-op.
    """

    names: tuple[str, ...]
    kind: str
    reason: str
    allowed: tuple | None = None

    @property
    def dest(self) -> str:
        return self.names[0][2:].replace("-", "_")


def _noop(name: str, kind: str, reason: str, *aliases: str) -> VllmFlag:
    return VllmFlag((name, *aliases), kind, reason)


def _refuse(name: str, kind: str, reason: str, allowed: tuple = (), *aliases: str) -> VllmFlag:
    return VllmFlag((name, *aliases), kind, reason, allowed)


_TEXT_ONLY = "manylora serves text-only decoder models (no multimodal inputs)"
_NO_MOE = ("manylora has no expert parallelism: a mixture-of-experts layer's experts are split "
           "over the tensor-parallel ranks (--tensor-parallel-size)")
_NO_DP = ("manylora runs one engine per server; run replicas with `manylora serve-ray` "
          "(--num-replicas)")
_GRAPHS = ("manylora picks its own CUDA graph sizes (decode graphs by batch size; "
           "--piecewise-cuda-graph-sizes for the other steps; --enforce-eager turns them off)")
_NOT_YET = "not supported yet"

#: Every vLLM serve flag that manylora has no flag of its own for (vLLM 0.11's parser, and
#: flags of 0.10's still found in launch lines).
VLLM_FLAGS: tuple[VllmFlag, ...] = (
    # vllm serve's own
    _refuse("--headless", "bool", "manylora has no headless (engine-only) mode", (False,)),
    _refuse("--api-server-count", "int", "manylora runs one API server process", (1,), "-asc"),
    # front end
    _refuse("--uds", "str", "manylora listens on TCP (--host, --port) only"),
    _refuse("--enable-ssl-refresh", "bool", "manylora reads its TLS files once, at start",
            (False,)),
    _refuse("--middleware", "list", "manylora loads no extra ASGI middleware"),
    _refuse("--enable-request-id-headers", "bool", _NOT_YET, (False,)),
    _refuse("--exclude-tools-when-tool-choice-none", "bool", _NOT_YET, (False,)),
    _refuse("--tool-server", "str", "manylora runs no built-in tool servers"),
    _refuse("--log-config-file", "str", "manylora logs through Python's logging as "
            "configured by its caller; configure uvicorn with --uvicorn-log-level"),
    _refuse("--disable-fastapi-docs", "bool", _NOT_YET, (False,)),
    _refuse("--enable-server-load-tracking", "bool", _NOT_YET, (False,)),
    _noop("--enable-tokenizer-info-endpoint", "bool",
          "GET /tokenizer_info is always served"),
    _refuse("--enable-log-outputs", "bool", _NOT_YET, (False,)),
    _refuse("--h11-max-header-count", "int", _NOT_YET, (256,)),
    _noop("--log-error-stack", "bool", "error responses are logged as they are"),
    _refuse("--tokens-only", "bool", _NOT_YET, (False,)),
    # model
    _refuse("--runner", "str", "manylora runs generative models only",
            ("auto", "generate")),
    _refuse("--convert", "str", "manylora runs generative models only", ("auto", "none")),
    _refuse("--task", "str", "manylora runs generative models only", ("auto", "generate")),
    _refuse("--hf-config-path", "str", "manylora reads the config of --model"),
    _noop("--allowed-local-media-path", "str", _TEXT_ONLY),
    _noop("--allowed-media-domains", "list", _TEXT_ONLY),
    _noop("--code-revision", "str", "manylora runs no model code from the hub"),
    _refuse("--rope-scaling", "str", "manylora uses the checkpoint's RoPE settings"),
    _refuse("--rope-theta", "float", "manylora uses the checkpoint's RoPE settings"),
    _refuse("--tokenizer-revision", "str", "the tokenizer is read at --revision"),
    _refuse("--logprobs-mode", "str", "manylora returns the log-probabilities of the "
            "model's own distribution (vLLM's raw_logprobs)", ("raw_logprobs",)),
    _refuse("--disable-sliding-window", "bool", "manylora uses the checkpoint's attention "
            "window", (False,)),
    _noop("--disable-cascade-attn", "bool", "manylora has no cascade attention"),
    _refuse("--enable-prompt-embeds", "bool", "prompts are text or token ids", (False,)),
    _refuse("--config-format", "str", "manylora reads Hugging Face configs (and GGUF "
            "files)", ("auto", "hf")),
    _refuse("--hf-token", "str", "set HF_TOKEN in the environment (huggingface_hub reads "
            "it)"),
    _refuse("--hf-overrides", "str", "manylora uses the checkpoint's config as it is"),
    _refuse("--pooler-config", "str", "manylora runs generative models only"),
    _refuse("--override-pooler-config", "str", "manylora runs generative models only"),
    _noop("--logits-processor-pattern", "str",
          "manylora takes no logits processors from requests"),
    _refuse("--enable-sleep-mode", "bool", _NOT_YET, (False,)),
    _noop("--model-impl", "str", "manylora runs its own model implementation"),
    _refuse("--override-attention-dtype", "str", "attention runs in the model's dtype"),
    _refuse("--logits-processors", "list", "manylora loads no custom logits processors"),
    _refuse("--io-processor-plugin", "str", "manylora runs generative models only"),
    # loading
    _noop("--safetensors-load-strategy", "str",
          "manylora reads safetensors lazily, one tensor at a time"),
    _refuse("--model-loader-extra-config", "str", "manylora has one model loader"),
    _noop("--ignore-patterns", "list", "manylora downloads only the files it reads"),
    _noop("--use-tqdm-on-load", "bool", "manylora shows no load progress bar"),
    _noop("--pt-load-map-location", "str", "weights are read to the host, then placed"),
    # structured outputs
    _refuse("--guided-decoding-backend", "str", "manylora's structured outputs are "
            "xgrammar's", ("xgrammar", "auto")),
    _noop("--guided-decoding-disable-fallback", "bool",
          "xgrammar is the only backend: there is nothing to fall back to"),
    _refuse("--guided-decoding-disable-any-whitespace", "bool", "vLLM 0.10's; use "
            "--structured-outputs-config '{\"disable_any_whitespace\": true}'", (False,)),
    _refuse("--guided-decoding-disable-additional-properties", "bool", "vLLM 0.10's; use "
            "--structured-outputs-config '{\"disable_additional_properties\": true}'",
            (False,)),
    # parallelism
    _refuse("--distributed-executor-backend", "str", "manylora's tensor-parallel ranks are "
            "processes of this host (vLLM's mp)", ("mp",)),
    _refuse("--pipeline-parallel-size", "int", "manylora does not split layers over GPUs "
            "(pipeline parallelism); use --tensor-parallel-size", (1,), "-pp"),
    _refuse("--decode-context-parallel-size", "int", "manylora has no context parallelism",
            (1,), "-dcp"),
    _refuse("--data-parallel-size", "int", _NO_DP, (1,), "-dp"),
    _refuse("--data-parallel-rank", "int", _NO_DP, (), "-dpn"),
    _refuse("--data-parallel-start-rank", "int", _NO_DP, (), "-dpr"),
    _refuse("--data-parallel-size-local", "int", _NO_DP, (), "-dpl"),
    _refuse("--data-parallel-address", "str", _NO_DP, (), "-dpa"),
    _refuse("--data-parallel-rpc-port", "int", _NO_DP, (), "-dpp"),
    _noop("--data-parallel-backend", "str", _NO_DP, "-dpb"),
    _refuse("--data-parallel-hybrid-lb", "bool", _NO_DP, (False,)),
    _refuse("--enable-expert-parallel", "bool", _NO_MOE, (False,)),
    _noop("--all2all-backend", "str", _NO_MOE),
    _refuse("--enable-dbo", "bool", "manylora has no dual-batch overlap", (False,)),
    _noop("--dbo-decode-token-threshold", "int", "manylora has no dual-batch overlap"),
    _noop("--dbo-prefill-token-threshold", "int", "manylora has no dual-batch overlap"),
    _noop("--disable-nccl-for-dp-synchronization", "bool", _NO_DP),
    _refuse("--enable-eplb", "bool", _NO_MOE, (False,)),
    _noop("--eplb-config", "str", _NO_MOE),
    _noop("--expert-placement-strategy", "str", _NO_MOE),
    _noop("--num-redundant-experts", "int", _NO_MOE),
    _noop("--eplb-window-size", "int", _NO_MOE),
    _noop("--eplb-step-interval", "int", _NO_MOE),
    _noop("--eplb-log-balancedness", "bool", _NO_MOE),
    _noop("--max-parallel-loading-workers", "int",
          "each tensor-parallel rank reads its own shard"),
    _noop("--ray-workers-use-nsight", "bool", "manylora's ranks are not Ray workers"),
    _noop("--disable-custom-all-reduce", "bool",
          "manylora's tensor-parallel all-reduce is NCCL's (torch.distributed)"),
    _refuse("--worker-cls", "str", "manylora has one worker", ("auto",)),
    _refuse("--worker-extension-cls", "str", "manylora has one worker", ("",)),
    _noop("--enable-multimodal-encoder-data-parallel", "bool", _TEXT_ONLY),
    # KV cache
    _refuse("--kv-cache-memory-bytes", "int", "size the KV cache with "
            "--gpu-memory-utilization or --num-kv-blocks"),
    _noop("--prefix-caching-hash-algo", "str",
          "prefix blocks are keyed by their tokens and adapter"),
    _refuse("--cpu-offload-gb", "float", "manylora keeps the weights on the GPU", (0, 0.0)),
    _refuse("--calculate-kv-scales", "bool", "quantized KV caches are scaled per token "
            "and head as they are written (--kv-cache-dtype)", (False,)),
    _refuse("--kv-sharing-fast-prefill", "bool", _NOT_YET, (False,)),
    _noop("--mamba-cache-dtype", "str", "manylora serves attention models only"),
    _noop("--mamba-ssm-cache-dtype", "str", "manylora serves attention models only"),
    _noop("--mamba-block-size", "int", "manylora serves attention models only"),
    # multimodal
    *(_noop(name, kind, _TEXT_ONLY) for name, kind in (
        ("--limit-mm-per-prompt", "str"), ("--enable-mm-embeds", "bool"),
        ("--media-io-kwargs", "str"), ("--mm-processor-kwargs", "str"),
        ("--mm-processor-cache-gb", "float"), ("--disable-mm-preprocessor-cache", "bool"),
        ("--mm-processor-cache-type", "str"), ("--mm-shm-cache-max-object-size-mb", "int"),
        ("--mm-encoder-tp-mode", "str"), ("--mm-encoder-attn-backend", "str"),
        ("--interleave-mm-strings", "bool"), ("--skip-mm-profiling", "bool"),
        ("--video-pruning-rate", "float"))),
    # LoRA
    _refuse("--lora-extra-vocab-size", "int", "manylora's adapters cannot add tokens to "
            "the vocabulary", (0,)),
    _refuse("--default-mm-loras", "str", "manylora serves text-only models: there are no "
            "modalities to map to adapters"),
    _refuse("--enable-lora-bias", "bool", "manylora's adapters have no bias terms (peft's "
            "lora_bias)", (False,)),
    _refuse("--long-lora-scaling-factors", "list", "manylora has no long-context LoRA "
            "(LongLoRA's scaled RoPE)"),
    # observability
    _noop("--show-hidden-metrics-for-version", "str", "manylora hides no metrics"),
    _refuse("--otlp-traces-endpoint", "str", "manylora exports no OpenTelemetry traces"),
    _refuse("--collect-detailed-traces", "list", "manylora exports no OpenTelemetry traces"),
    # scheduler
    _noop("--max-num-partial-prefills", "int",
          "manylora's scheduler chunks prefills within --max-num-batched-tokens"),
    _noop("--max-long-partial-prefills", "int",
          "manylora's scheduler chunks prefills within --max-num-batched-tokens"),
    _noop("--long-prefill-token-threshold", "int",
          "manylora's scheduler chunks prefills within --max-num-batched-tokens"),
    _noop("--num-lookahead-slots", "int", "manylora has no speculative decoding"),
    _noop("--enable-chunked-prefill", "bool", "manylora always chunks long prefills to "
          "--max-num-batched-tokens a step"),
    _noop("--disable-chunked-mm-input", "bool", _TEXT_ONLY),
    _refuse("--scheduler-cls", "str", "manylora has one scheduler (--scheduling-policy)",
            ("", "vllm.core.scheduler.Scheduler")),
    _noop("--disable-hybrid-kv-cache-manager", "bool",
          "manylora has one kind of KV cache block"),
    # compilation
    _noop("--cudagraph-capture-sizes", "list", _GRAPHS),
    _noop("--cuda-graph-sizes", "list", _GRAPHS),
    _noop("--max-cudagraph-capture-size", "int", _GRAPHS),
    _noop("--max-seq-len-to-capture", "int", _GRAPHS),
    _noop("--compilation-config", "str", "manylora compiles no graphs with torch.compile; "
          + _GRAPHS, "-O"),
    # vLLM's config
    _refuse("--speculative-config", "str", "manylora has no speculative decoding"),
    _refuse("--kv-transfer-config", "str", "manylora does not move KV caches between "
            "servers"),
    _refuse("--kv-events-config", "str", "manylora publishes no KV cache events"),
    _noop("--additional-config", "str", "manylora reads no platform-specific config"),
    _noop("--aggregate-engine-logging", "bool", _NO_DP),
)

_TYPES = {"int": int, "float": float, "str": str, "list": str}


def add_vllm_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every flag of :data:`VLLM_FLAGS` (default None: not given), vLLM's short aliases
    of flags manylora has (``-tp``, ``-q``), and ``--num-gpu-blocks-override`` (vLLM's name of
    ``--num-kv-blocks``)."""
    group = parser.add_argument_group(
        "vLLM flags manylora has no use for", "accepted so that vLLM launch lines run: each "
        "is either a no-op (one INFO line) or refused with the reason when its value would "
        "change what the server does")
    for flag in VLLM_FLAGS:
        kwargs: dict = {"dest": flag.dest, "default": None, "help": flag.reason.replace("%",
                                                                                       "%%")}
        if flag.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _TYPES[flag.kind]
            if flag.kind == "list":
                kwargs["nargs"] = "+"
        group.add_argument(*flag.names, **kwargs)
    group.add_argument("-tp", dest="tensor_parallel_size", type=int,
                       default=argparse.SUPPRESS, help="--tensor-parallel-size")
    group.add_argument("-q", dest="quantization", type=str,
                       default=argparse.SUPPRESS, help="--quantization")
    group.add_argument("--num-gpu-blocks-override", dest="num_kv_blocks", type=int,
                       default=argparse.SUPPRESS, help="--num-kv-blocks")
    return parser


def check_vllm_flags(args: argparse.Namespace) -> None:
    """Log one INFO line per no-op flag given; refuse the first flag given a value manylora
    cannot honour.

    Raises:
        ValueError: ``--FLAG VALUE: reason`` for a refused value.
    """
    for flag in VLLM_FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        shown = _shown(flag, value)
        if flag.allowed is not None and value not in flag.allowed:
            raise ValueError(f"{shown}: {flag.reason}")
        logger.info("%s: no effect in manylora (%s)", shown, flag.reason)


def _shown(flag: VllmFlag, value: object) -> str:
    """The flag as given: ``--x``, ``--no-x``, ``--x 3`` or ``--x a b``."""
    name = flag.names[0]
    if flag.kind == "bool":
        return name if value else "--no-" + name[2:]
    if isinstance(value, list):
        return " ".join([name, *map(str, value)])
    return f"{name} {value}"


def expand_config_file(parser: argparse.ArgumentParser, args: Sequence[str]) -> list[str]:
    """``args`` with ``--config FILE`` replaced by the flags of that YAML file, put before
    the others, as vLLM's ``FlexibleArgumentParser`` reads a config file: the file is a mapping
    of flag names (with dashes or underscores, without ``--``) to values; ``true`` gives the
    flag alone, ``false`` its ``--no-`` form where the parser has one (else nothing), a list
    its items after the flag, a mapping its JSON, anything else its ``str``. Flags on the
    command line come after the file's, so they win.

    Raises:
        ValueError: ``--config`` without a file, a file that is not ``.yaml`` / ``.yml``,
            cannot be read, or is not a mapping.
    """
    args = list(args)
    found = [i for i, a in enumerate(args) if a == "--config" or a.startswith("--config=")]
    if not found:
        return args
    i = found[-1]
    if args[i] == "--config":
        if i + 1 >= len(args):
            raise ValueError("--config needs a YAML file")
        path = args[i + 1]
        del args[i:i + 2]
    else:
        path = args.pop(i).split("=", 1)[1]
    if Path(path).suffix not in (".yaml", ".yml"):
        raise ValueError(f"--config {path}: the config file must be YAML (.yaml or .yml)")
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: the file must be a mapping of flag names to "
                         "values")
    options = {s for action in parser._actions for s in action.option_strings}
    out: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif "--no-" + flag[2:] in options:
                out.append("--no-" + flag[2:])
        elif isinstance(value, list):
            if value:
                out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out + args


class VllmArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that reads ``--config FILE`` (:func:`expand_config_file`) when
    it has that flag; a file's errors are argparse errors (exit status 2)."""

    def parse_known_args(self, args=None, namespace=None):
        if "--config" in self._option_string_actions:
            try:
                args = expand_config_file(self, sys.argv[1:] if args is None else args)
            except ValueError as e:
                self.error(str(e))
        return super().parse_known_args(args, namespace)
