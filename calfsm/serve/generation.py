"""The choices of one request, each a library stream, read as text pieces.

:class:`Choice` owns one :class:`~calfsm.generate.stream.Stream` (``executor.generate``: a
sequence of its own, released when the stream ends) and turns its token events into
:class:`Piece`\\ s of text for the client: the events' own text when the executor has
a tokenizer, else through the byte-level decoder. Stop strings are the stream's own
(``SamplingParams.stop``, or ``stop_sequences`` of their token ids without a
tokenizer): the library holds back what may begin one, never delivers a completed one
(OpenAI does not return it either) and ends the stream ``stop``, so the client's finish
reason and the library's metrics agree.

:func:`merged` runs the choices of a request concurrently and yields their pieces as
they come. Cancelling the task that reads it (a client gone) cancels every stream of
this request, and only those (``Stream.cancel`` in ``finally``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs

from calfsm.errors import CalfsmError
from calfsm.executor import DeviceExecutor
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.stream import FinishReason, GenerationResult, Stream, TokenEvent
from calfsm.generate.tokenizer import ByteDecoder

__all__ = ["Choice", "Piece", "merged"]

#: stream finish reasons -> OpenAI's (the others end in an error answer)
OPENAI_FINISH = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop"}


@attrs.frozen
class Piece:
    """Text (maybe empty) and the token ids it holds for choice ``index``; the last
    piece of a choice has ``finish_reason`` (``"stop"``/``"length"``) or ``error``.
    A token's piece carries the token's event (its logprobs, when asked for) and
    ``offset``, the characters of the choice's text before this piece."""

    index: int
    text: str
    tokens: tuple[int, ...]
    finish_reason: str | None = None
    error: CalfsmError | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    event: TokenEvent | None = None
    offset: int = 0
    #: prompt tokens whose KV the prompt cache gave (not prefilled again)
    cached_tokens: int = 0
    #: tool-call deltas this piece completed, in OpenAI's form (calfsm.serve.toolcalls:
    #: a chat with tools); ``text`` is then the content outside the calls
    tool_calls: tuple[dict[str, Any], ...] = ()


class Choice:
    """One choice: a stream, and its text decoder when the stream's events carry none."""

    def __init__(self, executor: DeviceExecutor, index: int, prompt: Sequence[int],
                 params: SamplingParams, *, deadline_s: float | None,
                 request_id: str | None = None, parent: str | None = None,
                 priority: int = 0, arrival: float | None = None) -> None:
        self.index = index
        self._decoder = None if executor.tokenizer is not None else ByteDecoder()
        self._sent = 0                           # tokens given to the client
        self._chars = 0                          # characters of text given to it
        self.stream: Stream = executor.generate(list(prompt), params,
                                                deadline_s=deadline_s,
                                                request_id=request_id, parent=parent,
                                                priority=priority, arrival=arrival)

    def push(self, event: TokenEvent) -> Piece:
        """A new token: the piece of text it completes (maybe empty)."""
        self._sent += 1
        offset = self._chars
        text = self._decoder.push(event.token) if self._decoder is not None \
            else event.text or ""
        self._chars += len(text)
        return Piece(self.index, text, (event.token,), event=event, offset=offset)

    def end(self, result: GenerationResult) -> Piece:
        """The choice's last piece: the text the decoder held, and why it ended."""
        reason = OPENAI_FINISH.get(result.finish_reason)
        if not reason:
            text = ""
        elif self._decoder is not None:
            text = self._decoder.flush()
        else:
            text = (result.text or "")[self._chars:]
        return Piece(self.index, text, (), reason, None if reason else result.error,
                     result.usage.prompt_tokens, self._sent, offset=self._chars,
                     cached_tokens=result.usage.cached_tokens)

    async def pieces(self) -> AsyncIterator[Piece]:
        try:
            async for event in self.stream:
                yield self.push(event)
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
