"""The reference model (``docs/reference-model.md``), vectorised with numpy.

Theory of operation
-------------------
Every calfsm driver computes the same deterministic "model" so goldens are exact and two
drivers can be compared bit for bit. All arithmetic is on unsigned 32-bit integers that
wrap modulo 2**32:

- the *hash chain*: ``h_p = step(kv[seq][p-1], token, p)`` per token, one 32-bit word of
  "KV cache" per position (:func:`chain_into`);
- an *embedding row* folds its exact bytes into one 32-bit word (:func:`embed_words`) that
  steps the chain as a token id would;
- the *logits* of a hash: ``V`` BF16 values derived from ``fmix32(h ^ v * 0x27D4EB2F)``
  (:func:`logits_bf16`), rounded to nearest even exactly as the spec says;
- the prefill *tile layout*: the last chunk of ``tile_d0`` tokens, the host reads row
  :func:`tile_row` ``(n - 1) % tile_d0``.

The hash chain is inherently sequential (each word depends on the previous one) and runs
as a plain-int loop; the vocabulary-wide logits are the hot path of every simulated job
and run as a fixed sequence of in-place numpy ufuncs over scratch arrays that a
:class:`LogitsKernel` allocates once per vocabulary size. One decode step at V=151936
costs about a millisecond and allocates nothing but what numpy's ufunc machinery keeps
on the stack: the caller passes the output array (the host buffer the device writes).

Scalar helpers (:func:`fmix32`, :func:`step`) work on Python ints and are what the pure
test implementation is compared with.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

__all__ = [
    "H_INIT",
    "LogitsKernel",
    "chain",
    "chain_into",
    "embed_words",
    "fmix32",
    "greedy",
    "kernel",
    "logits_bf16",
    "prefill_tile",
    "step",
    "tile_row",
]

M32 = 0xFFFFFFFF
H_INIT = 0x811C9DC5
TOKEN_MUL = 0x9E3779B1
POS_MUL = 0x85EBCA77
VOCAB_MUL = 0x27D4EB2F
C1 = 0x85EBCA6B
C2 = 0xC2B2AE35


def fmix32(x: int) -> int:
    """MurmurHash3's 32-bit finaliser on a Python int (taken modulo 2**32)."""
    x &= M32
    x ^= x >> 16
    x = (x * C1) & M32
    x ^= x >> 13
    x = (x * C2) & M32
    x ^= x >> 16
    return x


def _fmix32_into(u: np.ndarray, t: np.ndarray) -> None:
    """``fmix32`` of every element of the ``uint32`` array ``u``, in place (``t``: scratch
    of the same shape)."""
    np.right_shift(u, 16, out=t)
    u ^= t
    u *= np.uint32(C1)
    np.right_shift(u, 13, out=t)
    u ^= t
    u *= np.uint32(C2)
    np.right_shift(u, 16, out=t)
    u ^= t


def embed_words(rows: np.ndarray) -> np.ndarray:
    """The word each row of a 2-D array steps the chain with, over the row's bytes in
    memory order (as the host tensor holds it, whatever the dtype): ``fmix32`` of the
    sum (mod 2**32) of ``fmix32(256 * i + byte_i)``. Returns ``uint32[n]``."""
    b = np.ascontiguousarray(rows).view(np.uint8)
    n = b.shape[0]
    if n == 0:
        return np.empty(0, np.uint32)
    x = b.reshape(n, -1).astype(np.uint32)
    x += np.arange(x.shape[1], dtype=np.uint32) * np.uint32(256)
    _fmix32_into(x, np.empty_like(x))
    s = x.sum(axis=1, dtype=np.uint32)
    _fmix32_into(s, np.empty_like(s))
    return s


def step(h_prev: int, token: int, pos: int) -> int:
    """One link of the hash chain: the KV word of ``token`` at position ``pos``."""
    return fmix32(h_prev ^ ((token * TOKEN_MUL) & M32) ^ ((pos * POS_MUL) & M32))


def chain(tokens: Sequence[int], positions: Sequence[int] | None = None,
          h_prev: int = H_INIT) -> list[int]:
    """Hashes of ``tokens`` at consecutive positions on an empty cache (for tests)."""
    if positions is None:
        positions = range(len(tokens))
    out = []
    h = h_prev
    for t, p in zip(tokens, positions, strict=True):
        h = step(H_INIT if p == 0 else h, t, p)
        out.append(h)
    return out


def chain_into(kv: np.ndarray, tokens: np.ndarray, positions: np.ndarray, *,
               write: bool = True) -> list[int]:
    """Run the hash chain of ``tokens`` at ``positions`` against one sequence's KV words.

    ``kv`` is the sequence's ``uint32`` word array (at least ``max(positions) + 1`` long;
    the caller checked the positions). Token ``i`` reads ``kv[p_i - 1]`` (``H_INIT`` at
    position 0) and writes ``kv[p_i]`` — so non-consecutive or repeated positions behave
    exactly as the spec says. With ``write=False`` the chain still reads its own words
    (kept in a local overlay) but leaves ``kv`` untouched (a stale completion).
    Returns the hashes, one per token.
    """
    n = len(tokens)
    # Products of the whole job at once (uint32 wrapping), then a plain-int loop.
    tm = (tokens.astype(np.uint32) * np.uint32(TOKEN_MUL)).tolist()
    pos_u = positions.astype(np.int64)
    pm = (positions.astype(np.uint32) * np.uint32(POS_MUL)).tolist()
    pl = pos_u.tolist()
    hs = [0] * n
    p0 = pl[0]
    consecutive = n == 1 or bool(np.all(np.diff(pos_u) == 1))
    if consecutive:
        h = H_INIT if p0 == 0 else int(kv[p0 - 1])
        for i in range(n):
            x = h ^ tm[i] ^ pm[i]
            x ^= x >> 16
            x = (x * C1) & M32
            x ^= x >> 13
            x = (x * C2) & M32
            h = x ^ (x >> 16)
            hs[i] = h
        if write:
            kv[p0:p0 + n] = hs
        return hs
    overlay: dict[int, int] = {}
    for i in range(n):
        p = pl[i]
        if p == 0:
            h = H_INIT
        else:
            h = overlay.get(p - 1)
            if h is None:
                h = int(kv[p - 1])
        h = fmix32(h ^ tm[i] ^ pm[i])
        hs[i] = h
        if write:
            kv[p] = h
        else:
            overlay[p] = h
    return hs


class LogitsKernel:
    """The logits of one hash for a fixed vocabulary size, with reusable scratch.

    Not thread-safe (the scratch is shared); :func:`kernel` hands out one per thread.
    """

    def __init__(self, vocab: int) -> None:
        if vocab <= 0:
            raise ValueError(f"vocabulary size must be positive, got {vocab}")
        self.vocab = vocab
        self._vmul = np.arange(vocab, dtype=np.uint32)
        self._vmul *= np.uint32(VOCAB_MUL)
        self._u = np.empty(vocab, np.uint32)
        self._t = np.empty(vocab, np.uint32)
        self._i = self._u.view(np.int32)
        self._f = self._t.view(np.float32)
        self._bits = self._t
        self._hi = self._u.view(np.uint16)[1::2]   # high halves (little-endian)
        self._scale = np.float32(2.0 ** -20)
        self._sign = np.uint32(0x80000000)
        self._round = np.uint32(0x7FFF)
        self._one = np.uint32(1)

    def into(self, h: int, out: np.ndarray) -> np.ndarray:
        """Write the ``vocab`` BF16 bits of hash ``h`` into ``out`` (uint16, C-contiguous
        1-D view of length ``vocab``). Allocates nothing."""
        u, t = self._u, self._t
        np.bitwise_xor(self._vmul, np.uint32(h & M32), out=u)
        _fmix32_into(u, t)
        # (int32)(u >> 8) - 2**23 == arithmetic (u ^ 0x80000000) >> 8 (flip, sign-extend)
        u ^= self._sign
        np.right_shift(self._i, 8, out=self._i)
        # exact float32 of the value, times 2**-20 (exact: a power of two)
        np.copyto(self._f, self._i, casting="unsafe")   # a direct cast: no ufunc buffer
        self._f *= self._scale
        # round to nearest even: bits + 0x7FFF + ((bits >> 16) & 1), keep the high half
        np.right_shift(self._bits, 16, out=u)
        u &= self._one
        u += self._bits
        u += self._round
        np.copyto(out, self._hi)
        return out


_local = threading.local()


def kernel(vocab: int) -> LogitsKernel:
    """This thread's :class:`LogitsKernel` for ``vocab`` (built once, then reused)."""
    cache = getattr(_local, "kernels", None)
    if cache is None:
        cache = _local.kernels = {}
    k = cache.get(vocab)
    if k is None:
        k = cache[vocab] = LogitsKernel(vocab)
    return k


def logits_bf16(h: int, vocab: int, out: np.ndarray | None = None) -> np.ndarray:
    """BF16 bits (``uint16[vocab]``) of the logits of hash ``h``; into ``out`` if given."""
    if out is None:
        out = np.empty(vocab, np.uint16)
    return kernel(vocab).into(h, out)


def tile_row(n: int, tile_d0: int) -> int:
    """Row of the prefill output tile holding the last of ``n`` tokens' logits."""
    if n <= 0 or tile_d0 <= 0:
        raise ValueError(f"tile_row needs n >= 1 and tile_d0 >= 1, got {n}, {tile_d0}")
    return (n - 1) % tile_d0


def prefill_tile(hashes: Sequence[int], tile_d0: int, out: np.ndarray) -> np.ndarray:
    """Write the prefill output tile for a job whose tokens hashed to ``hashes``.

    ``out`` is ``uint16`` with ``tile_d0 * V`` elements (any shape, C-contiguous). Row
    ``r`` gets the logits of token ``r`` of the last chunk of ``tile_d0`` tokens; rows past
    the end of a short last chunk are zero.
    """
    n = len(hashes)
    rows = out.reshape(tile_d0, -1)
    vocab = rows.shape[1]
    k = kernel(vocab)
    start = ((n - 1) // tile_d0) * tile_d0
    last = hashes[start:]
    for r, h in enumerate(last):
        k.into(h, rows[r])
    if len(last) < tile_d0:
        rows[len(last):] = 0
    return out


_greedy_local = threading.local()


def greedy(bf16_row: np.ndarray) -> int:
    """Arg-max of a BF16 row read as float32 (``bits << 16``); ties to the lowest index,
    NaN as numpy's ``argmax`` treats it. Reuses one scratch array per thread and size."""
    row = bf16_row.reshape(-1)
    cache = getattr(_greedy_local, "scratch", None)
    if cache is None or cache.size != row.size:
        cache = _greedy_local.scratch = np.empty(row.size, np.uint32)
    np.copyto(cache, row)
    cache <<= np.uint32(16)
    return int(cache.view(np.float32).argmax())
