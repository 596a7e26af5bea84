"""calfsm errors as HTTP answers with an OpenAI-format body.

The status is the error class's own (``CalfsmError.http_status``, from the one table in
:mod:`calfsm.errors`), with two corrections a server needs:

- :class:`~calfsm.errors.Cancelled` (499) reaches a client only when the client did not
  cancel: a shutdown cancelled its job. That is 503, retryable;
- a status outside the table's statuses (none today) is 500.

The body is ``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it:
``type`` by status (``invalid_request_error`` for every 4xx a client must fix), ``code``
the gRPC name of the error in lower case (``resource_exhausted``, ``unavailable`` ...).
A retry-after hint becomes ``Retry-After`` (whole seconds, rounded up, at least 1) and
``retry-after-ms`` (which the official OpenAI client prefers). Only 429 and 503 carry it.

An error body never echoes much of what a client sent: a message that quotes client
input quotes it through :func:`clip` (a bounded ``repr``), and every message and
``param`` is cut at :data:`MAX_MESSAGE` / :data:`MAX_PARAM` characters whatever built it,
so a megabyte field value or model name costs the answer a few dozen bytes.
"""

from __future__ import annotations

import json
import math
from typing import Any

from calfsm.errors import CalfsmError, Cancelled

__all__ = ["ERROR_TYPES", "MAX_MESSAGE", "MAX_PARAM", "ApiError", "clip", "error_body",
           "from_calfsm", "invalid_argument"]

#: status -> OpenAI error type
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               404: "invalid_request_error", 405: "invalid_request_error",
               408: "invalid_request_error", 413: "invalid_request_error",
               431: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 501: "server_error",
               503: "service_unavailable_error", 504: "timeout_error"}
_RETRY_STATUSES = (429, 503)
#: longest message and ``param`` an error body carries (characters)
MAX_MESSAGE = 1024
MAX_PARAM = 64
#: longest quotation of client input in a message (characters of its repr)
CLIP = 48


def clip(value: object, limit: int = CLIP) -> str:
    """``repr(value)``, cut to ``limit`` characters (an ellipsis marks the cut): how a
    message quotes what a client sent. It stops building once ``limit`` is reached, so a
    huge string, a long list or a deep one costs O(limit) here, not O(its size)."""
    out: list[str] = []
    _emit(value, out, [limit + 1])
    return _cut("".join(out), limit)


def _emit(value: object, out: list[str], budget: list[int]) -> None:
    """Append a repr of ``value`` to ``out`` while ``budget[0]`` characters are left."""
    if budget[0] <= 0:
        return
    if isinstance(value, list | tuple | dict):
        is_dict = isinstance(value, dict)
        out.append("{" if is_dict else "[")
        budget[0] -= 1
        for i, item in enumerate(value.items() if is_dict else value):
            if budget[0] <= 0:
                return
            if i:
                out.append(", ")
                budget[0] -= 2
            if is_dict:
                _emit(item[0], out, budget)
                out.append(": ")
                budget[0] -= 2
                _emit(item[1], out, budget)
            else:
                _emit(item, out, budget)
        out.append("}" if is_dict else "]")
        budget[0] -= 1
        return
    if isinstance(value, str | bytes):
        text = repr(value[:budget[0]])
    elif isinstance(value, int) and not isinstance(value, bool) \
            and value.bit_length() > 3 * budget[0]:
        text = f"<an integer of {value.bit_length()} bits>"
    else:
        text = repr(value)
    out.append(text[:budget[0]])
    budget[0] -= len(text)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


class ApiError(Exception):
    """An HTTP error answer: status, message, OpenAI ``code`` and ``param``, and a
    retry-after hint in seconds (None: no ``Retry-After``)."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, retry_after_s: float | None = None) -> None:
        message = _cut(message, MAX_MESSAGE)
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = None if param is None else _cut(param, MAX_PARAM)
        self.retry_after_s = retry_after_s if status in _RETRY_STATUSES else None

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)

    def json(self) -> bytes:
        return json.dumps(self.body()).encode()

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        s = max(0.0, self.retry_after_s)
        return {"retry-after": str(max(1, math.ceil(s))),
                "retry-after-ms": str(max(1, math.ceil(s * 1e3)))}


def invalid_argument(message: str, param: str | None = None) -> ApiError:
    """A 400 refusing a request's field, named by ``param`` (OpenAI's)."""
    return ApiError(400, message, code="invalid_argument", param=param)


def error_body(status: int, message: str, *, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def from_calfsm(err: CalfsmError, *, param: str | None = None) -> ApiError:
    """The answer for ``err`` (see the module docstring)."""
    status = err.http_status
    retry = err.retry_after_s
    if isinstance(err, Cancelled):      # the client did not cancel: shutdown did
        status, retry = 503, 1.0 if retry is None else retry
    if status not in ERROR_TYPES:
        status = 500
    return ApiError(status, err.message, code=err.grpc_code.lower(), param=param,
                    retry_after_s=retry)
