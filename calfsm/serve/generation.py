"""The choices of one request, each a library stream, read as text pieces.

:class:`Choice` owns one :class:`~calfsm.streams.Stream` (``executor.generate``: a
sequence of its own, released when the stream ends) and turns its token events into
:class:`Piece`\\ s of text for the client: through the
:class:`~calfsm.serve.tokenizer.IncrementalDecoder`, holding back the tokens that may
begin a stop sequence of two or more tokens (a one-token stop is the stream's own
``stop_token_ids``). When a stop sequence is complete the choice cancels its stream,
drops the stop sequence (OpenAI does not return it) and ends with ``stop``.

:func:`merged` runs the choices of a request concurrently and yields their pieces as
they come. Cancelling the task that reads it (a client gone) cancels every stream of
this request, and only those (``Stream.cancel`` in ``finally``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import attrs

from calfsm.errors import CalfsmError
from calfsm.executor import DeviceExecutor
from calfsm.sampling import SamplingParams
from calfsm.serve.tokenizer import IncrementalDecoder
from calfsm.streams import FinishReason, GenerationResult, Stream

__all__ = ["Choice", "Piece", "merged"]

#: stream finish reasons -> OpenAI's (the others end in an error answer)
OPENAI_FINISH = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop"}


@attrs.frozen
class Piece:
    """Text (maybe empty) and the token ids it holds for choice ``index``; the last
    piece of a choice has ``finish_reason`` (``"stop"``/``"length"``) or ``error``."""

    index: int
    text: str
    tokens: tuple[int, ...]
    finish_reason: str | None = None
    error: CalfsmError | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Choice:
    """One choice: a stream, its decoder and its stop-sequence matcher."""

    def __init__(self, executor: DeviceExecutor, index: int, prompt: Sequence[int],
                 params: SamplingParams, stops: Sequence[Sequence[int]], *,
                 deadline_s: float | None) -> None:
        self.index = index
        self._stops = [tuple(s) for s in stops]
        self._held: list[int] = []               # may be the start of a stop sequence
        self._decoder = IncrementalDecoder()
        self._sent = 0                           # tokens given to the client
        self.stopped = False                     # a stop sequence ended it
        self.stream: Stream = executor.generate(list(prompt), params,
                                                deadline_s=deadline_s)

    def _release(self, upto: int) -> Piece:
        out, self._held = self._held[:upto], self._held[upto:]
        self._sent += len(out)
        return Piece(self.index, "".join(self._decoder.push(t) for t in out), tuple(out))

    def _hold_from(self) -> int:
        """How many held tokens are safe to send: all but the longest tail that is a
        proper prefix of a stop sequence."""
        held = self._held
        for k in range(min(len(held), max(map(len, self._stops)) - 1), 0, -1):
            tail = tuple(held[-k:])
            if any(s[:k] == tail for s in self._stops):
                return len(held) - k
        return len(held)

    def push(self, token: int) -> Piece | None:
        """A new token; the piece the client may have now (None: nothing yet)."""
        if not self._stops:
            self._sent += 1
            return Piece(self.index, self._decoder.push(token), (token,))
        self._held.append(token)
        for s in self._stops:
            if len(self._held) >= len(s) and tuple(self._held[-len(s):]) == s:
                del self._held[-len(s):]
                self.stopped = True
                self.stream.cancel()
                return self._release(len(self._held))
        keep = self._hold_from()
        return self._release(keep) if keep else None

    def end(self, result: GenerationResult) -> Piece:
        """The choice's last piece: what was held, and why it ended."""
        if self.stopped:
            reason: str | None = "stop"
            error = None
        else:
            reason = OPENAI_FINISH.get(result.finish_reason)
            error = None if reason else result.error
        tail = self._release(len(self._held)) if reason else Piece(self.index, "", ())
        text = tail.text + (self._decoder.flush() if reason else "")
        return Piece(self.index, text, tail.tokens, reason, error,
                     result.usage.prompt_tokens, self._sent)

    async def pieces(self) -> AsyncIterator[Piece]:
        try:
            async for event in self.stream:
                piece = self.push(event.token)
                if piece is not None and (piece.text or piece.tokens):
                    yield piece
                if self.stopped:
                    break
            yield self.end(await self.stream.final())
        finally:
            self.stream.cancel()        # a no-op once it ended


async def merged(choices: Sequence[Choice]) -> AsyncIterator[Piece]:
    """The pieces of every choice as they come (each choice's in order)."""
    if len(choices) == 1:
        async for piece in choices[0].pieces():
            yield piece
        return
    queue: asyncio.Queue[Piece | None] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for piece in choice.pieces():
                await queue.put(piece)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            piece = await queue.get()
            if piece is None:
                running -= 1
            else:
                yield piece
    finally:
        for t in tasks:
            t.cancel()
        for c in choices:
            c.stream.cancel()
