"""Schemathesis hooks of ``test_server_schemathesis.py``, loaded through
``SCHEMATHESIS_HOOKS``.

:func:`filter_case` leaves out the bodies of issue 28's finding 1, a fix of the engine core:
an output constraint (``structured_outputs``, a ``response_format`` other than text, or a
required or named ``tool_choice``) beside a token list (``allowed_token_ids``,
``bad_words``) that can forbid every token the constraint allows stops the engine for every
client. The coverage phase sends such bodies on every run since the document publishes
``allowed_token_ids`` as non-empty. Delete this module, and its use in the test, with that
fix: the run must then pass on every body.
"""

from __future__ import annotations

import schemathesis


def _constrained(body: dict) -> bool:
    fmt = body.get("response_format")
    return (body.get("structured_outputs") is not None
            or (isinstance(fmt, dict) and fmt.get("type") not in (None, "text"))
            or (body.get("tool_choice") not in (None, "none", "auto")))


@schemathesis.hook
def filter_case(context, case) -> bool:
    body = case.body
    if not isinstance(body, dict) or not _constrained(body):
        return True
    return not (body.get("allowed_token_ids") or body.get("bad_words"))
