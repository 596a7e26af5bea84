"""Reading the small files a person or a runner hands calfsm: bounded, never blocking.

Manifests, fault plans and evidence files are named by a user (``--manifest``,
``--faults``) or found in a directory anyone may write into (``*.json`` in the evidence
directory). Such a name may be a FIFO (an ``open`` for reading blocks until a writer
comes: forever), a directory, a symlink to ``/dev/zero`` (a read that never ends), a
file far larger than any manifest, or JSON nested thousands deep (the decoder recurses
once per level and raises ``RecursionError``). :func:`read_regular` opens without
blocking (``O_NONBLOCK``), accepts a regular file only (after ``fstat`` of what it
opened, so a symlink to a regular file is fine) and reads at most ``max_bytes``;
:func:`load_json` refuses nesting deeper than ``max_depth`` before the decoder sees it.
Both raise :class:`UnreadableFile` (a ``ValueError``) naming what is wrong, so each
loader turns it into its own error (``ManifestError``, ``InvalidArgument``, a problem of
the evidence store) in one line.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MAX_DEPTH", "UnreadableFile", "check_depth", "json_depth", "load_json",
           "read_or_raise", "read_regular", "reason"]

#: the deepest nesting any calfsm file needs is about 6; 64 leaves room and stays far
#: below the decoder's recursion limit wherever it is called from
MAX_DEPTH = 64

#: a JSON string (the unrolled form of ``"(?:[^"\\]|\\.)*"``: linear, no backtracking)
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_OPEN = np.frombuffer(b"[{", dtype=np.uint8)


class UnreadableFile(ValueError):
    """A file that is not a small regular file, or content nested too deep."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: str | os.PathLike, *, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them.

    Never blocks on a FIFO or a device: the file is opened with ``O_NONBLOCK`` and
    anything ``fstat`` does not call a regular file is refused, as is a file larger than
    ``max_bytes`` (also one that grows past it while being read). Raises
    :class:`UnreadableFile`, or ``OSError`` when the file cannot be opened."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(Path(path), flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFile(f"{_kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise UnreadableFile(f"{st.st_size} bytes, more than the {max_bytes} allowed")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise UnreadableFile(f"grew past the {max_bytes} bytes allowed while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def reason(e: Exception) -> str:
    """Why a file could not be read, in a few words (an ``OSError``'s ``strerror``)."""
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)


def read_or_raise(path: str | os.PathLike, *, max_bytes: int,
                  error: Callable[[str], Exception]) -> bytes:
    """:func:`read_regular`, or ``error(why)`` raised (a loader's own error class, one
    line) when the file cannot be opened or is no small regular file."""
    try:
        return read_regular(path, max_bytes=max_bytes)
    except (OSError, UnreadableFile) as e:
        raise error(reason(e)) from None


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in the JSON ``text`` (0: a scalar). Brackets
    inside strings do not count; in malformed text the count may be too high, never too
    low for the part a decoder would read."""
    structure = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not structure:
        return 0
    b = np.frombuffer(structure.encode("ascii"), dtype=np.uint8)
    steps = np.where(np.isin(b, _OPEN), 1, -1)
    return int(np.cumsum(steps).max(initial=0))


def check_depth(value: Any, *, max_depth: int = MAX_DEPTH) -> Any:
    """``value`` (parsed data: dicts, lists, scalars), unless it nests deeper than
    ``max_depth`` (:class:`UnreadableFile`). Iterative: it never recurses itself. For
    data a parser built (TOML) where no text scan can tell the depth first."""
    todo = [(value, 0)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else \
            item if isinstance(item, list | tuple) else ()
        for child in children:
            if isinstance(child, dict | list | tuple):
                if depth + 1 >= max_depth:
                    raise UnreadableFile(f"nested deeper than the {max_depth} allowed")
                todo.append((child, depth + 1))
    return value


def load_json(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)``, refusing (:class:`UnreadableFile`) nesting deeper than
    ``max_depth`` before decoding; a malformed document raises ``ValueError`` as
    ``json.loads`` does (bytes that are not UTF-8 too)."""
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8")
    depth = json_depth(text)
    if depth > max_depth:
        raise UnreadableFile(f"nested {depth} deep, more than the {max_depth} allowed")
    return json.loads(text)
