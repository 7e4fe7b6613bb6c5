"""Greedy reference generations from transformers + peft, and helpers to compare against them.

The reference runs the unmodified Hugging Face stack (eager attention, one prompt at a time, no
padding), so that an engine's output can be checked token by token. Near-ties in the reference
logits are treated as legitimate divergence points.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from manylora.testing.hf import hf_causal_lm

logger = logging.getLogger(__name__)

__all__ = ["ReferenceOutput", "agreement", "compare_greedy", "hf_greedy_reference"]


class ReferenceOutput(NamedTuple):
    """One greedy reference generation.

    Attributes:
        token_ids: the generated token ids (prompt excluded); ends with EOS if generation stopped
            on it, otherwise has ``max_new_tokens`` entries.
        logits: one float32 CPU tensor of shape ``[vocab_size]`` per generated token: the raw
            (unprocessed) next-token logits the token was chosen from.
    """

    token_ids: list[int]
    logits: list[torch.Tensor]


def _load_reference_model(
    base_dir: str | Path,
    adapters: Mapping[str, str | Path],
    device: str | torch.device,
    dtype: torch.dtype,
    base_model: Any = None,
) -> Any:
    if base_model is not None:              # peft wraps in place: keep the caller's intact
        import copy

        model = copy.deepcopy(base_model).to(dtype)
    else:
        model = hf_causal_lm(base_dir, dtype=dtype, attn_implementation="eager")
    model.to(device)
    model.eval()
    if not adapters:
        return model

    from peft import PeftModel

    names = list(adapters)
    first = names[0]
    peft_model = PeftModel.from_pretrained(model, str(adapters[first]), adapter_name=first)
    for name in names[1:]:
        peft_model.load_adapter(str(adapters[name]), adapter_name=name)
    peft_model.to(device)
    peft_model.eval()
    return peft_model


@torch.no_grad()
def hf_greedy_reference(
    base_dir: str | Path,
    adapters: Mapping[str, str | Path],
    prompts: Sequence[Sequence[int]],
    adapter_names: Sequence[str | None],
    max_new_tokens: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    base_model: Any = None,
) -> list[ReferenceOutput]:
    """Greedy-decode each prompt with transformers (+ peft) and return tokens and logits.

    The base is loaded once with ``AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype,
    attn_implementation="eager")`` (a ``.gguf`` file: its folder with ``gguf_file=``, which
    dequantizes it through the ``gguf`` package); all ``adapters`` are loaded into one
    ``PeftModel`` under their names. Each prompt runs alone (batch 1, no padding) through
    ``generate(do_sample=False, max_new_tokens=...)``, with ``set_adapter(name)`` or, for
    ``None``, inside ``disable_adapter()`` (the pure base). Generation stops on the checkpoint's
    EOS like normal greedy decoding. On bf16/fp16 bases peft keeps the adapter weights in
    float32 (its default ``autocast_adapter_dtype=True``).

    Args:
        base_dir: checkpoint directory, or a GGUF file.
        adapters: adapter name -> peft adapter directory (may be empty).
        prompts: token ids per prompt (including any BOS), each non-empty.
        adapter_names: one adapter name (a key of ``adapters``) or ``None`` per prompt.
        max_new_tokens: maximum number of generated tokens per prompt (>= 1).
        device: where to run.
        dtype: dtype to load the base in.
        base_model: the base already loaded from ``base_dir`` as the reference loads it
            (``hf_causal_lm(base_dir, attn_implementation="eager")``), to skip loading it
            again; a copy is used, in ``dtype``.

    Returns:
        One :class:`ReferenceOutput` per prompt, in order.

    Raises:
        ValueError: mismatched lengths, an empty prompt, ``max_new_tokens < 1`` or an unknown
            adapter name.
    """
    if len(prompts) != len(adapter_names):
        raise ValueError(f"{len(prompts)} prompts but {len(adapter_names)} adapter names")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    for name in adapter_names:
        if name is not None and name not in adapters:
            raise ValueError(f"unknown adapter {name!r}; known: {sorted(adapters)}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be non-empty")

    model = _load_reference_model(base_dir, adapters, device, dtype, base_model)
    gen_cfg = model.generation_config
    pad_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else gen_cfg.eos_token_id

    results: list[ReferenceOutput] = []
    with _dora_caching():
        for prompt, name in zip(prompts, adapter_names, strict=True):
            results.append(_greedy_one(model, prompt, name, bool(adapters), max_new_tokens,
                                       pad_id, device))
    return results


def _dora_caching() -> Any:
    """peft's ``DoraCaching`` (the weight norms of each DoRA adapter computed once, not at
    every step: the same values, much faster), or a null context without DoRA support."""
    import contextlib

    try:
        from peft.helpers import DoraCaching
    except ImportError:
        return contextlib.nullcontext()
    return DoraCaching()


def _greedy_one(model: Any, prompt: Sequence[int], name: str | None, has_adapters: bool,
                max_new_tokens: int, pad_id: int | None, device: str | torch.device
                ) -> ReferenceOutput:
    input_ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    kwargs: dict[str, Any] = dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=pad_id,
    )
    if name is None and has_adapters:
        with model.disable_adapter():
            out = model.generate(**kwargs)
    else:
        if name is not None:
            model.set_adapter(name)
        out = model.generate(**kwargs)
    new_tokens = out.sequences[0, input_ids.shape[1] :].tolist()
    logits = [step[0].detach().to("cpu", torch.float32) for step in out.logits]
    if len(logits) != len(new_tokens):
        raise RuntimeError(f"generate returned {len(new_tokens)} tokens, {len(logits)} logits")
    logger.debug("reference %s: %d prompt -> %d new tokens", name, len(prompt), len(new_tokens))
    return ReferenceOutput(token_ids=new_tokens, logits=logits)


def compare_greedy(
    ours: Sequence[int], ref: ReferenceOutput, tie_tol: float = 1e-5
) -> tuple[bool, int]:
    """Compare a generated sequence against a greedy reference, forgiving near-ties.

    Walks both sequences token by token. At the first differing position ``i``, if the reference
    logit of our token is within ``tie_tol`` of the reference maximum
    (``ref.logits[i][ours[i]] >= ref.logits[i].max() - tie_tol``), it is a tie: both choices are
    valid greedy picks, the sequences may legitimately diverge afterwards, and ``(True, i)`` is
    returned. Otherwise it is a real mismatch: ``(False, i)``. Identical sequences give
    ``(True, len)``. If one sequence is a strict prefix of the other, the lengths differ without
    a tie: ``(False, shorter_len)``.

    Returns:
        ``(ok, position)``: whether the sequences agree, and where comparison stopped.
    """
    n = min(len(ours), len(ref.token_ids))
    for i in range(n):
        if int(ours[i]) == int(ref.token_ids[i]):
            continue
        if i < len(ref.logits):
            step = ref.logits[i]
            tok = int(ours[i])
            if 0 <= tok < step.shape[-1] and float(step[tok]) >= float(step.max()) - tie_tol:
                return True, i
        return False, i
    if len(ours) != len(ref.token_ids):
        return False, n
    return True, n


def agreement(
    ours_list: Sequence[Sequence[int]], refs: Sequence[ReferenceOutput], tie_tol: float = 1e-5
) -> float:
    """Fraction of all reference tokens matched before the first non-tie divergence.

    For each pair, :func:`compare_greedy` decides: a sequence that agrees (identical, or ended
    by a tie) counts all of its reference tokens as matched; one with a real mismatch at ``i``
    counts ``i``. Useful to report e.g. bf16-on-GPU agreement. Returns 1.0 when there are no
    reference tokens at all.

    Raises:
        ValueError: when the two lists have different lengths.
    """
    if len(ours_list) != len(refs):
        raise ValueError(f"{len(ours_list)} outputs but {len(refs)} references")
    total = sum(len(r.token_ids) for r in refs)
    if total == 0:
        return 1.0
    matched = 0
    for ours, ref in zip(ours_list, refs, strict=True):
        ok, pos = compare_greedy(ours, ref, tie_tol=tie_tol)
        matched += len(ref.token_ids) if ok else pos
    return matched / total
