"""calfsm.util.boundedio: the depth a text scan finds is the depth the decoder would recurse
to (brackets inside strings, escaped quotes included), and a file is read only when it
is a small regular file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from calfsm.util.boundedio import (
    UnreadableFile,
    check_depth,
    json_depth,
    load_json,
    read_regular,
)

#: text full of what could fool a scan: brackets, quotes, backslashes
TRICKY = st.text(alphabet='[]{}"\\,: ab\n\u00e9', max_size=12)
VALUES = st.recursive(st.none() | st.integers() | TRICKY,
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(TRICKY, inner, max_size=3), max_leaves=20)


def depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


@given(VALUES, st.booleans())
def test_the_scan_finds_the_nesting_of_any_document(value: object, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert json_depth(text) == depth(value)
    check_depth(value, max_depth=depth(value))
    if depth(value) > 1:
        with pytest.raises(UnreadableFile):
            check_depth(value, max_depth=depth(value) - 1)
        with pytest.raises(UnreadableFile):
            load_json(text, max_depth=depth(value) - 1)
    assert load_json(text, max_depth=depth(value)) == value


def test_read_regular_reads_regular_files_only_and_within_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    path.write_bytes(b"x" * 10)
    assert read_regular(path, max_bytes=10) == b"x" * 10
    with pytest.raises(UnreadableFile, match="10 bytes, more than the 9 allowed"):
        read_regular(path, max_bytes=9)
    link = tmp_path / "link.json"
    link.symlink_to(path)                          # a symlink to a regular file is fine
    assert read_regular(link, max_bytes=10) == b"x" * 10
    fifo = tmp_path / "p.json"
    os.mkfifo(fifo)
    with pytest.raises(UnreadableFile, match="a FIFO"):
        read_regular(fifo, max_bytes=10)
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "absent", max_bytes=10)
