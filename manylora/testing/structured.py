"""What the tests accept as the refusal of an output constraint that admits no token."""

from __future__ import annotations


def names_an_empty_constraint(message: str) -> bool:
    """Whether an error says its output constraint admits no token: the engine's own words,
    or, for a schema that is only a ``$ref`` cycle, xgrammar's compile-time refusal (0.2.9 and
    later refuse such a schema while compiling it; earlier releases compile it to a grammar
    that admits no token, which the engine finds)."""
    return "no token" in message or "Circular $ref chain with no schema content" in message
