"""peft's LoRA scaling of each module of an adapter (``PeftScaling``): ``alpha / r`` or,
with ``use_rslora``, ``alpha / sqrt(r)``, alpha and the expected rank from ``alpha_pattern``
/ ``rank_pattern`` as peft's ``get_pattern_key`` matches them."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from manylora.lora.adapter import LoRAAdapterError
from manylora.lora.formats.moe_paths import parameter_targeted
from manylora.lora.formats.patterns import MatchBudget, PatternTable

logger = logging.getLogger(__name__)


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
        self.target_parameters = cfg.get("target_parameters") or []
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
        """The scaling of module ``module_key`` (e.g. ``model.layers.0.self_attn.q_proj``;
        for a ``ParamWrapper`` its parameter, ``model.layers.0.mlp.experts.gate_up_proj``)
        whose stored rank is ``r`` (≥ 1); a rank that disagrees with the config's is logged
        and used. A module whose ``weight`` the config's ``target_parameters`` reach (the
        router through ``mlp.gate.weight``) is matched as ``{module_key}.weight``, the name
        peft matches the patterns against then.

        Raises:
            LoRAAdapterError: the pattern matching budget ran out.
        """
        if self.target_parameters and parameter_targeted(f"{module_key}.weight",
                                                         self.target_parameters):
            module_key = f"{module_key}.weight"
        alpha = self.alphas.value(module_key, self.alpha)
        expected_r = self.ranks.value(module_key, self.r)
        if int(expected_r) != r:
            logger.warning("adapter %r: %s has rank %d, its config says %d; using %d",
                           self.name, module_key, r, expected_r, r)
        return alpha / math.sqrt(r) if self.rslora else alpha / r
