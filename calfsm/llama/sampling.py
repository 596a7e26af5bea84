"""llama.cpp's sampler chain on a context's logits: the logits processors, then greedy
or a seeded draw.

llama.cpp builds a chain (``llama_sampler_chain_init``, then ``llama_sampler_chain_add``
of ``llama_sampler_init_logit_bias``, ``..._top_k``, ``..._top_p``, ``..._temp`` and
last ``..._greedy`` or ``..._dist(seed)``) and calls ``llama_sampler_sample(chain, ctx,
i)`` on batch token ``i``'s logits. :class:`SamplerChain` is that chain over one
:class:`~calfsm.generate.sampling.SamplingParams`: its ``logits_processors`` (such as
:func:`calfsm.generate.processors.logit_bias` and
:func:`calfsm.generate.processors.ban_tokens`) run in order, then ``temperature`` 0 is
greedy and anything else the seeded draw with
``top_k``/``top_p`` (:mod:`calfsm.generate.sampling`), which consumes one random output per
token as ``dist`` does.

One difference, on purpose: llama.cpp copies the row into a candidates array of the
vocabulary's size before its samplers touch it; here the processors and a draw work on
the context's own row (``ctx.get_logits_ith(i)``, in place: no vocabulary-size copy).
That row is the chain's after :meth:`SamplerChain.sample`: read what you need from it
before.
"""

from __future__ import annotations

from collections.abc import Sequence

from calfsm.errors import InvalidArgument
from calfsm.generate.processors import TokenHistory
from calfsm.generate.sampling import Sampler, SamplingParams
from calfsm.llama.context import LlamaContext

__all__ = ["SamplerChain"]


class SamplerChain:
    """``llama_sampler`` chain: ``sample(ctx, i)`` chooses the next token from batch
    token ``i``'s logits, after the params' logits processors. The processors see
    ``prompt`` and every accepted token (``accept``; ``sample`` accepts its own), as
    llama.cpp's samplers do. One chain per sequence: it owns the draw's generator."""

    def __init__(self, params: SamplingParams, n_vocab: int,
                 prompt: Sequence[int] = ()) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidArgument(f"params must be SamplingParams, got {type(params).__name__}",
                                  stage="llama_sampler")
        self.params = params
        self.n_vocab = n_vocab
        self._prompt = tuple(int(t) for t in prompt)
        self._sampler: Sampler = params.sampler_for(n_vocab, prompt_len=len(self._prompt))
        self._accepted: list[int] = []

    @property
    def tokens(self) -> tuple[int, ...]:
        """The prompt and the accepted tokens: what the processors see."""
        return self._prompt + tuple(self._accepted)

    def sample(self, ctx: LlamaContext, i: int = -1) -> int:
        """``llama_sampler_sample``: the token for batch token ``i`` (negative: counted
        from the last output) of the last decode, accepted into the chain. The row is
        changed in place (processors; a draw consumes it)."""
        if ctx.n_vocab != self.n_vocab:
            raise InvalidArgument(f"the chain was made for a vocabulary of {self.n_vocab}, "
                                  f"the context has {ctx.n_vocab}", stage="llama_sampler")
        row = ctx.get_logits_ith(i)
        tokens = TokenHistory(self._prompt, self._accepted) if self._sampler.uses_tokens \
            else ()
        token = self._sampler.sample(row, tokens)
        self._accepted.append(token)
        return token

    def accept(self, token: int) -> None:
        """``llama_sampler_accept``: ``token`` joins what the processors see (a token
        chosen elsewhere, such as a forced one)."""
        if isinstance(token, bool) or not isinstance(token, int) \
                or not 0 <= token < self.n_vocab:
            raise InvalidArgument(f"token must be an id in [0, {self.n_vocab}), got "
                                  f"{token!r}", stage="llama_sampler")
        self._accepted.append(token)

    def reset(self) -> None:
        """``llama_sampler_reset``: no accepted tokens, and the draw starts again from
        its seed."""
        self._accepted.clear()
        self._sampler = self.params.sampler_for(self.n_vocab, prompt_len=len(self._prompt))
