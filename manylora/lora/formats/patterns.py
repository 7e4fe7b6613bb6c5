"""PEFT's ``rank_pattern`` / ``alpha_pattern``, matched as PEFT matches them, with bounded
work.

PEFT (``peft.utils.other.get_pattern_key``) gives a module the value of the first key, in
the config's order, for which ``re.match(rf"(.*\\.)?({key})$", module)`` matches, else the
default (``r`` / ``lora_alpha``). A key is a Python regex written by whoever made the
adapter: one such as ``(.?)*(.?)*X`` backtracks exponentially, and CPython's ``re`` holds
the GIL while it does (it would stall every thread of the engine). So here:

* a key made of word characters and dots only (``q_proj``,
  ``model.layers.3.self_attn.v_proj``) is matched without a regex, by what the regex means
  for it: the last ``len(key)`` characters of ``module`` equal the key, a ``.`` of the key
  matching any character, and ``module`` is that long or has a ``.`` just before them;
* any other key must compile under ``re`` (PEFT's engine, so an invalid key is refused
  as PEFT would fail on it) and is matched with the ``regex`` package (same syntax and
  semantics for ``re``'s patterns), which releases the GIL while matching
  (``concurrent=True``) and stops at a deadline (``timeout``);
* all matching of one adapter shares one time budget (``MATCH_BUDGET_S``); compiling holds
  the GIL (some 30 us per character), so the keys that need a regex may hold
  ``MAX_REGEX_CHARS`` characters in all; a key longer than ``MAX_KEY_CHARS`` or more than
  ``MAX_KEYS`` keys are refused outright.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Mapping

import regex

from manylora.lora.adapter import LoRAAdapterError

#: The longest pattern key accepted (characters).
MAX_KEY_CHARS = 512
#: The most keys one ``rank_pattern`` or ``alpha_pattern`` may hold.
MAX_KEYS = 4096
#: Characters the keys of one table that need a regex may hold in all.
MAX_REGEX_CHARS = 2048
#: Seconds all pattern matching of one adapter may take.
MATCH_BUDGET_S = 1.0

_LITERAL = re.compile(r"[\w.]+")


class PatternTable:
    """One of an adapter's ``rank_pattern`` / ``alpha_pattern``, checked and compiled.

    Args:
        field: ``"rank_pattern"`` or ``"alpha_pattern"`` (for messages and the value type:
            ranks are positive integers, alphas finite numbers).
        patterns: the config's dict, ``{key: value}``; None or empty: no pattern.
        what: how messages name the adapter, e.g. ``"adapter 'x'"``.
        budget: a shared ``MatchBudget`` (one per adapter).

    Raises:
        LoRAAdapterError: not a dict; a key that is not a string, is empty or longer than
            ``MAX_KEY_CHARS``, or does not compile under ``re``; more than ``MAX_KEYS`` keys;
            a value of the wrong type (a bool is not a number).
    """

    def __init__(self, field: str, patterns: object, what: str, budget: MatchBudget) -> None:
        self.field, self.what, self.budget = field, what, budget
        self._keys: list[tuple[str, regex.Pattern | None, float]] = []
        self._regex_chars = 0
        if patterns is None:
            return
        if not isinstance(patterns, Mapping):
            raise LoRAAdapterError(f"{what}: {field} must be an object of module patterns, "
                                   f"got {type(patterns).__name__}")
        if len(patterns) > MAX_KEYS:
            raise LoRAAdapterError(f"{what}: {field} has {len(patterns)} keys, more than "
                                   f"{MAX_KEYS}")
        for key, value in patterns.items():
            self._keys.append((key, self._compile(key), self._check_value(key, value)))

    def _compile(self, key: object) -> regex.Pattern | None:
        if not isinstance(key, str) or not key:
            raise LoRAAdapterError(f"{self.what}: {self.field} key {key!r} is not a non-empty "
                                   "string")
        if len(key) > MAX_KEY_CHARS:
            raise LoRAAdapterError(f"{self.what}: {self.field} key {key[:40]!r}... is "
                                   f"{len(key)} characters long, more than {MAX_KEY_CHARS}")
        if _LITERAL.fullmatch(key):
            return None
        self._regex_chars += len(key)
        if self._regex_chars > MAX_REGEX_CHARS:
            raise LoRAAdapterError(f"{self.what}: the regex keys of {self.field} hold more "
                                   f"than {MAX_REGEX_CHARS} characters in all")
        return compile_bounded(rf"(.*\.)?({key})$", f"{self.what}: {self.field} key {key!r}")

    def _check_value(self, key: str, value: object) -> float:
        if self.field == "rank_pattern":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LoRAAdapterError(f"{self.what}: {self.field}[{key!r}] = {value!r} is not "
                                       "a positive integer rank")
            return value
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value)):
            raise LoRAAdapterError(f"{self.what}: {self.field}[{key!r}] = {value!r} is not a "
                                   "finite number")
        return value

    def items(self) -> list[tuple[str, float]]:
        """``(key, value)`` in the config's order."""
        return [(key, value) for key, _, value in self._keys]

    def value(self, module: str, default: float) -> float:
        """The value of the first key that matches ``module`` (PEFT's ``get_pattern_key``),
        else ``default``.

        Raises:
            LoRAAdapterError: the adapter's matching budget ran out (naming the key).
        """
        for key, pattern, value in self._keys:
            if pattern is None:
                if _literal_match(key, module):
                    return value
                continue
            if self.budget.match(pattern, module, f"{self.what}: matching {self.field} key "
                                 f"{key!r}"):
                return value
        return default

    def unmatched(self, modules: Iterable[str]) -> list[str]:
        """The keys that match none of ``modules`` (peft warns of them and ignores them).

        Raises:
            LoRAAdapterError: the adapter's matching budget ran out (naming the key).
        """
        modules = list(modules)
        out = []
        for key, pattern, _ in self._keys:
            what = f"{self.what}: matching {self.field} key {key!r}"
            if pattern is None:
                hit = False
                for module in modules:
                    if _literal_match(key, module):
                        hit = True
                        break
                    self.budget.check(what)
            else:
                hit = any(self.budget.match(pattern, module, what) for module in modules)
            if not hit:
                out.append(key)
        return out


def compile_bounded(pattern: str, what: str) -> regex.Pattern:
    """``pattern`` compiled with the ``regex`` package (matched with ``MatchBudget.match``)
    once ``re`` (peft's engine) accepts it.

    Raises:
        LoRAAdapterError: ``re`` or ``regex`` refuses it (``what`` names it).
    """
    try:
        re.compile(pattern)
        return regex.compile(pattern)
    except (re.error, regex.error, RecursionError, OverflowError) as e:
        raise LoRAAdapterError(f"{what} is not a valid regular expression ({e})") from None


def _literal_match(key: str, module: str) -> bool:
    """``re.match(rf"(.*\\.)?({key})$", module)`` for a key of word characters and dots
    (``.`` any character) and a module name without newlines."""
    n = len(key)
    if len(module) < n or (len(module) > n and module[-n - 1] != "."):
        return False
    return all(k == "." or k == m for k, m in zip(key, module[-n:]))


class MatchBudget:
    """The time all pattern matching of one adapter may take, from its creation.

    Args:
        seconds: the budget (``MATCH_BUDGET_S``).
    """

    def __init__(self, seconds: float = MATCH_BUDGET_S) -> None:
        self.seconds = seconds
        self._deadline = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (at least a microsecond: ``regex`` reads 0 as "no timeout")."""
        return max(self._deadline - time.monotonic(), 1e-6)

    def _spent(self, what: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"{what} against the module names took more than "
                                f"{self.seconds:g} s (a pattern that backtracks without bound)")

    def check(self, what: str) -> None:
        """Raises ``LoRAAdapterError`` (naming ``what``) once the budget is spent."""
        if time.monotonic() > self._deadline:
            raise self._spent(what)

    def match(self, pattern: regex.Pattern, module: str, what: str,
              full: bool = False) -> regex.Match | None:
        """``pattern`` matched at the start of ``module`` (all of it with ``full``), the
        ``regex`` package releasing the GIL, within the budget left; None: no match.

        Raises:
            LoRAAdapterError: the budget ran out (``what`` names the pattern).
        """
        method = pattern.fullmatch if full else pattern.match
        try:
            return method(module, timeout=self.left(), concurrent=True)
        except TimeoutError:
            raise self._spent(what) from None
