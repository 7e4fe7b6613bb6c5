"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

The ``type`` strings are those vLLM and OpenAI use, so the official ``openai`` client maps
each status to its exception class (400 ``BadRequestError``, 401 ``AuthenticationError``,
403 ``PermissionDeniedError``, 404 ``NotFoundError``, 413 and 503 ``APIStatusError``).
"""

from __future__ import annotations

from http import HTTPStatus


class OpenAIError(Exception):
    """An error for one HTTP request, turned into a JSON response by the server.

    Args:
        status: the HTTP status code (400, 401, 403, 404, 413, 503, ...).
        message: what is wrong, naming the parameter or the resource.
        type: OpenAI's error type; defaults from ``status``.
        param: the request parameter at fault, if one is.
        code: a machine-readable code (a string such as ``"context_length_exceeded"``);
            defaults to the status code.
    """

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
             404: "NotFoundError", 413: "RequestTooLargeError", 422: "BadRequestError",
             429: "RateLimitError", 500: "InternalServerError",
             503: "ServiceUnavailableError", 504: "TimeoutError"}

    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None, code: str | int | None = None) -> None:
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
