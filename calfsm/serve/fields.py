"""attrs validators of the server's configuration records (:class:`ServerConfig`,
:class:`ConnectionLimits`): a bad value is an InvalidArgument naming ``Record.field``."""

from __future__ import annotations

from typing import Any

import attrs

from calfsm.errors import InvalidArgument

__all__ = ["count", "count_or_none", "non_negative", "positive", "positive_or_none"]


def _bad(inst: object, attr: attrs.Attribute, what: str, value: Any) -> InvalidArgument:
    return InvalidArgument(f"{type(inst).__name__}.{attr.name} must be {what}, got "
                           f"{value!r}", stage="config")


def positive_or_none(inst: object, attr: attrs.Attribute, value: Any) -> None:
    """None, or a number > 0 (not a bool)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or not value > 0):
        raise _bad(inst, attr, "> 0", value)


def positive(inst: object, attr: attrs.Attribute, value: Any) -> None:
    """A number > 0."""
    if value is None:
        raise InvalidArgument(f"{type(inst).__name__}.{attr.name} must be given",
                              stage="config")
    positive_or_none(inst, attr, value)


def count(inst: object, attr: attrs.Attribute, value: Any) -> None:
    """An integer >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(inst, attr, "an integer >= 1", value)


def count_or_none(inst: object, attr: attrs.Attribute, value: Any) -> None:
    """None, or an integer >= 1."""
    if value is not None:
        count(inst, attr, value)


def non_negative(inst: object, attr: attrs.Attribute, value: Any) -> None:
    """A finite number >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 \
            or value == float("inf"):
        raise _bad(inst, attr, "a finite number >= 0", value)
