"""OpenAI response bodies and stream chunks, for completions and for chat.

:class:`Shape` knows one endpoint's object names and where its text goes (``text`` for
completions, ``message``/``delta`` ``content`` for chat); the app hands it pieces and
usage, and the ``logprobs`` objects of :mod:`calfsm.serve.logprobs` when a request
asks for them. :class:`EventStream` is the SSE response: it listens for the client's disconnect
whatever ASGI version the server speaks, and closes the body iterator in every case, so a
client that goes away cancels its own streams at once.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from calfsm.serve.generation import Piece
from calfsm.serve.logprobs import chat_logprobs, completion_logprobs

__all__ = ["CHAT", "COMPLETION", "EventStream", "Shape", "sse"]


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event holding ``data`` (a dict as JSON)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                         separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` when the prompt
    cache gave some of the prompt's KV."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                           "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


class Shape:
    """The bodies of one endpoint (``chat`` or not)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.prefix = "chatcmpl-" if chat else "cmpl-"

    def new_id(self) -> str:
        return self.prefix + uuid.uuid4().hex

    def _head(self, rid: str, model: str, created: int, obj: str) -> dict[str, Any]:
        return {"id": rid, "object": obj, "created": created, "model": model}

    def logprobs(self, pieces: Sequence[Piece]) -> dict[str, Any]:
        """The ``logprobs`` object of the tokens in ``pieces``, in this endpoint's form."""
        return chat_logprobs(pieces) if self.chat else completion_logprobs(pieces)

    def body(self, rid: str, model: str, texts: list[str], reasons: list[str],
             used: dict[str, Any], pieces: list[list[Piece]] | None = None,
             tool_calls: list[list[dict[str, Any]]] | None = None) -> dict[str, Any]:
        """The non-streaming answer: one choice per text; ``pieces`` (each choice's
        token pieces) when the request asked for logprobs; ``tool_calls`` (each choice's
        calls) when it offered tools: a choice with calls has them in its message, and
        ``content`` null when it wrote no other text, as OpenAI answers."""
        lps = [None] * len(texts) if pieces is None else [self.logprobs(p) for p in pieces]
        if self.chat:
            calls = tool_calls or [[] for _ in texts]
            choices = [{"index": i, "message": _message(t, c), "logprobs": lp,
                        "finish_reason": r}
                       for i, (t, r, lp, c) in enumerate(zip(texts, reasons, lps, calls))]
        else:
            choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": r}
                       for i, (t, r, lp) in enumerate(zip(texts, reasons, lps))]
        return self._head(rid, model, int(time.time()), self.object) | {
            "choices": choices, "usage": used}

    def chunk(self, rid: str, model: str, created: int, piece: Piece, *,
              include_usage: bool, role: bool = False, logprobs: bool = False,
              used: dict[str, Any] | None = None) -> dict[str, Any]:
        """A streaming chunk of ``piece`` (``role``: chat's first chunk of a choice;
        ``logprobs``: the request asked for them, so a token's piece carries its own;
        ``used``: the usage so far, ``stream_options.continuous_usage_stats``)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": piece.text} if role \
                else ({"content": piece.text} if piece.text or not (
                    piece.finish_reason or piece.tool_calls) else {})
            if piece.tool_calls:
                delta["tool_calls"] = list(piece.tool_calls)
            choice: dict[str, Any] = {"index": piece.index, "delta": delta}
        else:
            choice = {"index": piece.index, "text": piece.text}
        lp = self.logprobs((piece,)) if logprobs and piece.event is not None else None
        choice |= {"logprobs": lp, "finish_reason": piece.finish_reason}
        out = self._head(rid, model, created, self.chunk_object) | {"choices": [choice]}
        if include_usage:
            out["usage"] = used
        return out

    def usage_chunk(self, rid: str, model: str, created: int,
                    used: dict[str, Any]) -> dict[str, Any]:
        """``stream_options.include_usage``: the last chunk, no choices."""
        return self._head(rid, model, created, self.chunk_object) | {
            "choices": [], "usage": used}


def _message(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat choice's message: its text, and its tool calls when it made some."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": calls}


COMPLETION = Shape(chat=False)
CHAT = Shape(chat=True)


class EventStream(StreamingResponse):
    """``text/event-stream`` from an async iterator of bytes; the iterator is cancelled
    and closed when the client disconnects (and closed when it ends any other way).
    ``close`` is awaited last in every case, even if the iterator never started (the
    server passes the choices' own iterator, so their streams are cancelled whatever
    happened); ``on_disconnect`` is called once if the client leaves before the end."""

    def __init__(self, content: AsyncIterator[bytes], status_code: int = 200, *,
                 close: Callable[[], Awaitable[None]] | None = None,
                 on_disconnect: Callable[[], None] | None = None) -> None:
        super().__init__(content, status_code=status_code, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self._events = content
        self._close = close
        self._on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False

        def left() -> None:
            nonlocal finished
            if not finished and self._on_disconnect is not None:
                self._on_disconnect()
            finished = True

        try:
            async with anyio.create_task_group() as tg:
                async def listen() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    left()
                    tg.cancel_scope.cancel()

                async def stream() -> None:
                    nonlocal finished
                    try:
                        await self.stream_response(send)
                        finished = True
                    except OSError:          # an ASGI 2.4 server: the client went away
                        left()
                    tg.cancel_scope.cancel()

                tg.start_soon(listen)
                tg.start_soon(stream)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._close is not None:
                await self._close()
