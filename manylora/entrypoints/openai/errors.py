"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

The ``type`` strings are those vLLM and OpenAI use, so the official ``openai`` client maps
each status to its exception class (400 ``BadRequestError``, 401 ``AuthenticationError``,
403 ``PermissionDeniedError``, 404 ``NotFoundError``, 413 and 503 ``APIStatusError``).
:class:`ErrorResponse` is that shape as a schema (the OpenAPI document's error component).

Every message passes through :func:`clean_message`, the one place that makes an error
readable: terminal colour codes (torch's hints carry them) removed, a prefix said twice
(``adapter 'x': adapter 'x': ...``) said once, server paths the caller never gave replaced
by the ones it did, and code points UTF-8 cannot encode written as escapes.
:func:`to_openai_error` maps what the engine raises to these errors; :func:`error_response`
is the JSON response of one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from http import HTTPStatus

from pydantic import BaseModel

from manylora.engine.async_llm import EngineDeadError, EngineOverloadedError
from manylora.entrypoints.openai.encoding import SafeJSONResponse, safe_text
from manylora.lora.adapter import LoRALoadTimeoutError

# ECMA-48 control sequences (colours, cursor moves): ESC [ parameters intermediates final.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
# A "prefix: " said twice or more in a row, at the start or after another "...: ".
_REPEATED_PREFIX = re.compile(r"(?:^|(?<=: ))([^:\n]{1,200}?: )\1+")


def clean_message(message: str, paths: Mapping[str, str] | None = None) -> str:
    """``message`` as an error should say it.

    Args:
        message: the text (an exception's ``str``, often).
        paths: ``{server path: what the caller gave}``; each server path in the message is
            replaced by the caller's (longest first), so resolved absolute paths do not leak.

    Returns:
        the message with ANSI escape sequences removed, a repeated ``prefix: prefix: ``
        collapsed to one, the ``paths`` replaced, and lone surrogates escaped
        (:func:`~manylora.entrypoints.openai.encoding.safe_text`).
    """
    text = _ANSI.sub("", str(message))
    for server_path, given in sorted((paths or {}).items(), key=lambda kv: -len(kv[0])):
        if server_path and server_path != given:
            text = text.replace(server_path, given)
    text = _REPEATED_PREFIX.sub(r"\1", text)
    return safe_text(text)


class ErrorInfo(BaseModel):
    """The ``error`` object of an error response (OpenAI's)."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """An error response body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class OpenAIError(Exception):
    """An error for one HTTP request, turned into a JSON response by the server.

    Args:
        status: the HTTP status code (400, 401, 403, 404, 413, 503, ...).
        message: what is wrong, naming the parameter or the resource; kept as
            :func:`clean_message` makes it.
        type: OpenAI's error type; defaults from ``status``.
        param: the request parameter at fault, if one is.
        code: a machine-readable code (a string such as ``"context_length_exceeded"``);
            defaults to the status code.
    """

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
             404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError",
             422: "BadRequestError",
             429: "RateLimitError", 500: "InternalServerError",
             503: "ServiceUnavailableError", 504: "TimeoutError"}

    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None, code: str | int | None = None) -> None:
        message = clean_message(message)
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = type or self.TYPES.get(self.status, HTTPStatus(self.status).phrase)
        self.param = param
        self.code = code if code is not None else self.status

    def body(self) -> dict:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """400: an invalid parameter."""
    return OpenAIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None) -> OpenAIError:
    """404: an unknown model or adapter."""
    return OpenAIError(404, message, param=param, code="model_not_found"
                       if param == "model" else None)


def too_large(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """413: a body, prompt or input over its bound."""
    return OpenAIError(413, message, param=param, code=code)


def overloaded(message: str) -> OpenAIError:
    """503: the waiting queue is full, or the engine is not serving."""
    return OpenAIError(503, message)


# What an engine ValueError's first word names, as the request's parameter: the engine
# core checks token ids against the vocabulary (the server does not know its size).
_ENGINE_PARAMS = {"prompt_token_ids": "prompt", "logit_bias": "logit_bias",
                  "allowed_token_ids": "allowed_token_ids", "bad_words": "bad_words"}


def to_openai_error(exc: BaseException) -> OpenAIError | None:
    """The HTTP error for an exception from a request's checks or from the engine: itself
    for an ``OpenAIError``, 400 for ``ValueError`` (bad prompt, parameters or adapter), 404
    for a missing adapter file, 503 for ``EngineOverloadedError`` and ``EngineDeadError``,
    504 for an adapter read over ``lora_load_timeout``; None for anything else (a server
    bug, left to propagate). A ``ValueError`` whose message starts with a field the engine
    core checks (``prompt_token_ids``, ``logit_bias``, ``allowed_token_ids``) names that
    field as the 400's ``param``."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, LoRALoadTimeoutError):
        return OpenAIError(504, str(exc), param="model", code="adapter_load_timeout")
    if isinstance(exc, EngineOverloadedError):
        return overloaded(f"the server is overloaded: {exc}")
    if isinstance(exc, EngineDeadError):
        return overloaded(f"the engine is not serving: {exc}")
    if isinstance(exc, FileNotFoundError):       # the file's name, not the server's path
        missing = (f"file {os.path.basename(str(exc.filename))} is" if exc.filename
                   else "files are")
        return not_found(f"the adapter's {missing} no longer on disk", param="model")
    if isinstance(exc, ValueError):
        message = str(exc)
        return bad_request(message, param=_ENGINE_PARAMS.get(message.split(" ", 1)[0]))
    return None


def error_response(error: OpenAIError, headers: dict[str, str] | None = None
                   ) -> SafeJSONResponse:
    """The JSON response of ``error``: its status and :meth:`OpenAIError.body`."""
    return SafeJSONResponse(error.body(), status_code=error.status, headers=headers)
