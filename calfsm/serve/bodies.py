"""Request bodies: read within a size limit, parsed as JSON within a depth limit.

:func:`read_body` reads the ASGI body up to ``max_bytes`` (413 past it, refused from a
``Content-Length`` before a byte is read). A client that goes away while it uploads raises
:class:`UploadAbandoned`, which the app logs at INFO and answers nobody.

:func:`parse_json` is a bounded parse: CPython's ``json`` recurses once per nesting
level, so a small body nested a thousand levels deep raises ``RecursionError`` from deep
inside the parser. Catching that would be relying on how much stack happens to be left, so
the depth is measured first, without parsing: the escapes are removed (one regular
expression, in C), the quotes left say which brackets are inside strings, and the
running count of the others is a cumulative sum (numpy, a megabyte at a time): linear in
the body, never recursive. A body deeper than ``max_depth`` is a 400 that says
so; only then is ``json.loads`` called, on a body it cannot recurse too deep in. The body
must be UTF-8 (RFC 8259 8.1), so a bracket byte is always a bracket.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from starlette.requests import ClientDisconnect, Request

from calfsm.serve.httperrors import ApiError

__all__ = ["UploadAbandoned", "json_depth", "parse_json", "read_body"]

#: an escape inside a JSON string: a backslash and the character it escapes
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
#: byte -> +1 opens an array or object, -1 closes one, 2 a quote, 0 anything else
_KIND = np.zeros(256, dtype=np.int8)
_KIND[[ord("["), ord("{")]] = 1
_KIND[[ord("]"), ord("}")]] = -1
_KIND[ord('"')] = 2
_CHUNK = 1 << 20                # bytes counted at a time (bounds the arrays' memory)


class UploadAbandoned(Exception):
    """The client disconnected before its request body was complete."""

    def __init__(self, received: int, declared: str | None) -> None:
        super().__init__(f"after {received} of {declared or 'unknown'} body bytes")
        self.received = received
        self.declared = declared


def _bad_json(message: str) -> ApiError:
    return ApiError(400, message, code="invalid_argument")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body of ``request``: 413 over ``max_bytes``, :class:`UploadAbandoned`
    if the client leaves first."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body is over {max_bytes} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise ApiError(413, f"the request body is over {max_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise UploadAbandoned(size, declared) from None
    return b"".join(chunks)


def json_depth(data: bytes) -> int:
    """How deep the arrays and objects of the JSON text ``data`` nest (0: a scalar),
    counted without parsing, in linear time. For text that is not JSON the count is
    meaningless (the parse that follows says what is wrong)."""
    # with every escape removed, each quote left opens or closes a string; escapes are
    # removed left to right, so a backslash run pairs up as the parser pairs it (an
    # escaped backslash, then an escaped quote: backslash-backslash-backslash-quote)
    codes = np.frombuffer(_ESCAPE.sub(b"", data), dtype=np.uint8)
    depth = deepest = 0
    in_string = 0
    for start in range(0, codes.size, _CHUNK):
        kinds = _KIND[codes[start:start + _CHUNK]]
        kinds = kinds[kinds != 0]
        if kinds.size == 0:
            continue
        quote = kinds == 2
        # 1 inside a string (after an odd number of quotes); a bracket there is text
        inside = (np.cumsum(quote, dtype=np.int32) + in_string) % 2
        steps = kinds[~quote & (inside == 0)]
        if steps.size:
            levels = np.cumsum(steps, dtype=np.int64) + depth
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
        in_string = int(inside[-1])
    return deepest


def parse_json(data: bytes, max_depth: int) -> Any:
    """``data`` as JSON: a 400 naming the problem for a body that is not UTF-8, nests
    deeper than ``max_depth`` or is not JSON."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad_json(f"the request body is not UTF-8 (byte {e.start})") from None
    depth = json_depth(data)
    if depth > max_depth:
        raise _bad_json(f"the request body nests {depth} levels deep; at most {max_depth} "
                        "are accepted")
    try:
        return json.loads(text)
    except ValueError as e:
        raise _bad_json(f"the request body is not JSON: {_reason(e)}") from None


def _reason(err: ValueError) -> str:
    """The parser's reason, which quotes no client text (``json`` says where, not what)."""
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg} at line {err.lineno} column {err.colno}"
    return str(err).split(":", 1)[0]      # e.g. an integer over the digit limit
