"""Stop strings over a stream's text: where one completes, and what may begin one.

A stream with stop strings (``SamplingParams.stop``) decodes each token's text and holds
back the tokens whose text may begin a stop string, as it holds tokens that may begin a
token-id stop sequence. :meth:`StopStrings.split` decides, over the texts of the tokens
held (in order, the newest last), how many are delivered and whether a stop string
completed:

- a stop string at character ``m`` of the held text: the tokens whose text ends before
  ``m`` are delivered whole, the one whose text straddles ``m`` only up to it, the rest
  never; the stream ends ``stop``;
- else the longest end of the held text that is a proper beginning of a stop string is
  held, with the tokens whose text overlaps it; a token with no text of its own at that
  boundary is held too (its bytes may begin the next character), so nothing of a stop
  string is ever delivered, a token's bytes included.

Each call looks only at the held text: a stop string that completes now begins within
it (an earlier start would have been a longer held beginning), so a token costs a scan of
at most the longest stop string plus the text of the tokens still held.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopStrings"]


class StopStrings:
    """The stop strings of one stream (non-empty; checked by ``SamplingParams``)."""

    __slots__ = ("_firsts", "_longest", "strings")

    def __init__(self, strings: Sequence[str]) -> None:
        self.strings = tuple(strings)
        self._firsts = frozenset(s[0] for s in self.strings)
        self._longest = max(map(len, self.strings), default=0)

    def find(self, text: str) -> int:
        """Where the first stop string in ``text`` begins (the earliest), else -1."""
        found = -1
        for s in self.strings:
            i = text.find(s)
            if i >= 0 and (found < 0 or i < found):
                found = i
        return found

    def held(self, text: str) -> int:
        """The length of the longest end of ``text`` that is a proper beginning of a stop
        string (it may complete later): the characters held back for now."""
        n = len(text)
        for i in range(max(0, n - self._longest + 1), n):
            if text[i] in self._firsts:
                tail = text[i:]
                if any(len(s) > len(tail) and s.startswith(tail) for s in self.strings):
                    return n - i
        return 0

    def split(self, pieces: Sequence[str]) -> tuple[int, int | None, bool]:
        """Over the texts of the held tokens: ``(whole, part, stopped)``: the first
        ``whole`` tokens are delivered as they are; ``part`` (when not None) is how many
        characters of the next one's text are delivered with it; ``stopped``: a stop
        string completed (nothing after these is ever delivered). Otherwise the tokens
        after ``whole`` stay held."""
        text = "".join(pieces)
        at = self.find(text)
        stopped = at >= 0
        if not stopped:
            at = len(text) - self.held(text)
        pos = 0
        for i, piece in enumerate(pieces):
            end = pos + len(piece)
            # held from here: its text reaches past the boundary, or it has none of its
            # own right at it
            if end > at or (end == pos == at):
                return i, (at - pos if stopped and pos < at else None), stopped
            pos = end
        return len(pieces), None, stopped
