"""OpenAI ``logprobs`` objects from a choice's token pieces.

Completions use the legacy form: ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``, one entry per token (``top_logprobs`` a ``{label: logprob}`` object
per token; ``text_offset`` the characters of the choice's text before the token). Chat
uses ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}]}], "refusal": null}``. A token is named by its label and bytes on
its own (:func:`~calfsm.serve.tokenizer.token_label`,
:func:`~calfsm.serve.tokenizer.token_bytes`): a byte that is not a whole UTF-8
character is ``bytes:\\xNN``, as OpenAI names such tokens. The values are those of the
row the sampler saw (after logits processors, before temperature, top-k and top-p), so
they do not depend on the request's sampling knobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from calfsm.generate.stream import TokenEvent
from calfsm.serve.generation import Piece
from calfsm.serve.tokenizer import token_bytes, token_label

__all__ = ["chat_logprobs", "completion_logprobs"]


def _events(pieces: Sequence[Piece]) -> list[tuple[Piece, TokenEvent]]:
    return [(p, p.event) for p in pieces if p.event is not None]


def completion_logprobs(pieces: Sequence[Piece]) -> dict[str, Any]:
    """The legacy completions ``logprobs`` of the tokens in ``pieces``."""
    scored = _events(pieces)
    return {
        "tokens": [token_label(e.token) for _, e in scored],
        "token_logprobs": [e.logprob for _, e in scored],
        "top_logprobs": [{token_label(t): lp for t, lp in e.top_logprobs}
                         for _, e in scored],
        "text_offset": [p.offset for p, _ in scored],
    }


def _entry(token: int, logprob: float | None) -> dict[str, Any]:
    return {"token": token_label(token), "logprob": logprob,
            "bytes": list(token_bytes(token))}


def chat_logprobs(pieces: Sequence[Piece]) -> dict[str, Any]:
    """Chat's ``logprobs`` of the tokens in ``pieces``."""
    return {"content": [_entry(e.token, e.logprob) | {
        "top_logprobs": [_entry(t, lp) for t, lp in e.top_logprobs]}
        for _, e in _events(pieces)], "refusal": None}
