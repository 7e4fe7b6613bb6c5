"""One decoder family's greedy case: a tiny checkpoint, peft adapters on it, prompts with the
adapter each runs under, and transformers + peft's greedy reference; and the engine runs
checked against that reference, token for token."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from manylora.lora_request import LoRARequest
from manylora.testing.adapters import make_peft_adapter
from manylora.testing.reference import ReferenceOutput, compare_greedy, hf_greedy_reference

if TYPE_CHECKING:
    from manylora.engine.outputs import CompletionOutput
    from manylora.sampling_params import SamplingParams

__all__ = ["FAMILY_ADAPTER_NAMES", "FAMILY_SPECS", "FAMILY_TEXTS", "FamilyCase",
           "assert_greedy_matches", "generate_greedy", "generate_twice_from_prefix_cache",
           "lora_requests", "make_family_case", "shutting_down"]

#: The family tests' prompts. The first and the third differ only in their last word: under
#: :func:`~manylora.testing.make_tokenizer`'s tokenizer (every
#: :func:`~manylora.testing.make_checkpoint` checkpoint's) they share their first 22 tokens,
#: five full KV blocks of 4, and they run under the same adapter, so that a second pass
#: reads cached prefixes.
FAMILY_TEXTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog", "SELECT name FROM users WHERE",
    "The quick brown fox jumps over the lazy cat", "def add(a, b):", "Low-rank adaptation")
#: The adapter (a key of :data:`FAMILY_SPECS`) or ``None`` (the base) per
#: :data:`FAMILY_TEXTS` prompt: one mixed batch.
FAMILY_ADAPTER_NAMES: tuple[str | None, ...] = ("attn", None, "attn", "all", "dora")
#: :func:`~manylora.testing.make_peft_adapter` arguments of three ranks and targets:
#: attention only (r=4), every linear layer (r=8), and DoRA over q, v and down (r=2).
FAMILY_SPECS: dict[str, dict[str, Any]] = {
    "attn": {"r": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "all": {"r": 8, "target_modules": "all-linear"},
    "dora": {"r": 2, "target_modules": ["q_proj", "v_proj", "down_proj"], "use_dora": True},
}

#: ``make_checkpoint`` arguments of a tiny mixture-of-experts decoder: the shared sizes
#: (:data:`MOE_TINY`), then per family the experts (:data:`MOE_FAMILIES`): Mixtral's 4 of
#: intermediate 96, Qwen2-MoE's 4 of 48 with a shared expert of 64 and a dense second layer,
#: Qwen3-MoE's 8 of 48 (top-2 everywhere).
MOE_TINY: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=128)
MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=64, norm_topk_prob=False,
                      mlp_only_layers=[1]),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True, head_dim=32),
}


@dataclass(frozen=True)
class FamilyCase:
    """A checkpoint, its adapters and prompts, and the greedy reference for them.

    ``dataclasses.replace`` gives a sub-case (some prompts with their reference) or one with
    more adapters; the adapters' order gives their ``lora_int_id`` (see
    :func:`lora_requests`), so keep the first ones first.

    Attributes:
        base_dir: the checkpoint folder, or a GGUF file.
        adapters: adapter name -> peft (or TensorRT-LLM) adapter directory, in id order.
        prompts: token ids per prompt (BOS included where the tokenizer adds one).
        adapter_names: the adapter (a key of ``adapters``) or ``None`` (the base) per prompt.
        reference: transformers + peft's greedy output per prompt
            (:func:`~manylora.testing.reference.hf_greedy_reference`).
    """

    base_dir: Path
    adapters: dict[str, Path]
    prompts: list[list[int]]
    adapter_names: list[str | None]
    reference: list[ReferenceOutput]


def make_family_case(
    base_dir: str | Path,
    root: str | Path,
    specs: Mapping[str, Mapping[str, Any]],
    prompts: Sequence[str | Sequence[int]],
    adapter_names: Sequence[str | None],
    max_new_tokens: int,
) -> FamilyCase:
    """Write peft adapters for the checkpoint in ``base_dir`` and compute the reference.

    The base is loaded once, as the reference loads it (``hf_causal_lm(base_dir,
    dtype=torch.float32, attn_implementation="eager")``), and shared, as a copy, by every
    adapter and the reference. Adapter ``name`` is ``make_peft_adapter(base_dir,
    root / name, seed=i + 1, **specs[name])`` for the ``i``-th of ``specs`` (a ``seed`` in
    the spec wins). A text prompt is tokenized by the checkpoint's own tokenizer
    (``AutoTokenizer``, special tokens added); a list of ids is used as it is.

    Args:
        base_dir: a checkpoint folder (see :func:`~manylora.testing.make_checkpoint`) or a
            GGUF file.
        root: the folder the adapters are written under.
        specs: adapter name -> :func:`~manylora.testing.make_peft_adapter` keyword
            arguments (may be empty).
        prompts: a text or token ids per prompt.
        adapter_names: a name of ``specs`` or ``None`` per prompt.
        max_new_tokens: the reference's greedy length (it also stops at EOS).

    Returns:
        The :class:`FamilyCase`, its adapters in the order of ``specs``.

    Raises:
        ValueError: from peft (a target that matches nothing) or from
            ``hf_greedy_reference`` (mismatched lengths, an unknown adapter name).
    """
    from manylora.testing.hf import hf_causal_lm

    base_dir, root = Path(base_dir), Path(root)
    model = hf_causal_lm(base_dir, dtype=torch.float32, attn_implementation="eager")
    adapters = {name: make_peft_adapter(base_dir, root / name, base_model=model,
                                        **{"seed": i + 1, **spec})
                for i, (name, spec) in enumerate(specs.items())}
    ids = _token_ids(base_dir, prompts)
    reference = hf_greedy_reference(base_dir, adapters, ids, adapter_names, max_new_tokens,
                                    base_model=model)
    return FamilyCase(base_dir, adapters, ids, list(adapter_names), reference)


def _token_ids(base_dir: Path, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
    if not any(isinstance(p, str) for p in prompts):
        return [list(p) for p in prompts]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    return [tok(p).input_ids if isinstance(p, str) else list(p) for p in prompts]


def lora_requests(adapters: Mapping[str, str | Path],
                  adapter_names: Sequence[str | None]) -> list[LoRARequest | None]:
    """One ``LoRARequest(name, id, path)`` per name (``None`` stays ``None``: the base), the
    ``i``-th adapter of ``adapters`` with ``lora_int_id`` ``i + 1``.

    Raises:
        KeyError: a name that is not in ``adapters``.
    """
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    return [None if n is None else LoRARequest(n, ids[n], str(adapters[n]))
            for n in adapter_names]


@contextmanager
def shutting_down(llm: Any) -> Iterator[Any]:
    """Yield ``llm`` (a ``manylora.LLM``) and shut its engine down on exit, also when the
    body raises (``llm.llm_engine.shutdown()``: its core, workers and tensor-parallel
    processes end)."""
    try:
        yield llm
    finally:
        llm.llm_engine.shutdown()


def generate_greedy(llm: Any, case: FamilyCase, params: SamplingParams
                    ) -> list[CompletionOutput]:
    """Run the case's prompts as one ``llm.generate`` call (vLLM's ``LLM.generate``: one
    batch, each prompt under its adapter, see :func:`lora_requests`).

    Args:
        llm: a ``manylora.LLM``.
        params: the sampling parameters of every prompt.

    Returns:
        Each prompt's first (only) ``CompletionOutput``, in prompt order.
    """
    outs = llm.generate([{"prompt_token_ids": p} for p in case.prompts], params,
                        lora_request=lora_requests(case.adapters, case.adapter_names),
                        use_tqdm=False)
    return [o.outputs[0] for o in outs]


def assert_greedy_matches(outputs: Sequence[CompletionOutput], case: FamilyCase) -> list[int]:
    """Assert each output's tokens equal the case's reference, up to a near-tie
    (:func:`~manylora.testing.reference.compare_greedy`).

    Returns:
        Per prompt, the position where the comparison stopped: the length when the tokens
        are equal, else the near-tie's position.

    Raises:
        AssertionError: naming the prompt, its adapter, the first diverging position and
            both token lists.
    """
    positions = []
    for i, (out, ref) in enumerate(zip(outputs, case.reference, strict=True)):
        ok, pos = compare_greedy(out.token_ids, ref)
        assert ok, (f"prompt {i} (adapter {case.adapter_names[i]}): diverges at token {pos}: "
                    f"ours {out.token_ids} ref {ref.token_ids}")
        positions.append(pos)
    return positions


def generate_twice_from_prefix_cache(
    llm: Any,
    case: FamilyCase,
    params: SamplingParams,
    check: Callable[[list[CompletionOutput], FamilyCase], object] = assert_greedy_matches,
) -> tuple[int, int]:
    """Run the case's batch twice on an engine with prefix caching, ``check`` each pass,
    and assert that the second pass read cached prefixes (more prefix hits than after the
    first).

    Args:
        llm: a ``manylora.LLM`` built with ``enable_prefix_caching=True``.
        params: the sampling parameters of every prompt.
        check: called with each pass's outputs and the case (default:
            :func:`assert_greedy_matches`).

    Returns:
        The adapter cache's ``device_misses`` (adapters loaded into a slot) after the first
        pass and after the second.

    Raises:
        AssertionError: from ``check``, or no new prefix hits on the second pass.
    """
    engine = llm.llm_engine
    check(generate_greedy(llm, case, params), case)
    hits, first = engine.kv_cache_stats().prefix_hits, engine.lora_cache_stats().device_misses
    check(generate_greedy(llm, case, params), case)
    assert engine.kv_cache_stats().prefix_hits > hits, "the second pass hit no cached prefix"
    return first, engine.lora_cache_stats().device_misses
