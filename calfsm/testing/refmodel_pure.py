"""An independent pure-Python reference model, written from the spec text alone.

Plain ints, no numpy: the oracle the numpy model (:mod:`calfsm.drivers.refmodel`) and every
driver are checked against. Deliberately straightforward and slow; keep V small.
"""

from __future__ import annotations

import struct

__all__ = ["H_INIT", "MASK", "bf16_to_float", "embed_word", "fmix32", "generate", "greedy",
           "hashes", "logit_bf16", "logits_bf16", "prefill_tile", "step"]

MASK = 0xFFFFFFFF
H_INIT = 0x811C9DC5


def fmix32(x: int) -> int:
    x &= MASK
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & MASK
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & MASK
    x ^= x >> 16
    return x


def step(h_prev: int, token: int, pos: int) -> int:
    return fmix32(h_prev ^ ((token * 0x9E3779B1) & MASK) ^ ((pos * 0x85EBCA77) & MASK))


def embed_word(row: bytes) -> int:
    """The 32-bit word an embedding row (its exact bytes) contributes in place of a token."""
    total = 0
    for i, b in enumerate(row):
        total = (total + fmix32((256 * i + b) & MASK)) & MASK
    return fmix32(total)


def hashes(tokens: list[int], start: int = 0, kv: dict[int, int] | None = None) -> list[int]:
    """Hashes of ``tokens`` at positions ``start, start+1, ...`` against a KV dict
    (``pos -> word``; missing words read 0), which is updated."""
    kv = {} if kv is None else kv
    out = []
    for i, t in enumerate(tokens):
        p = start + i
        prev = H_INIT if p == 0 else kv.get(p - 1, 0)
        h = step(prev, t & MASK, p)
        kv[p] = h
        out.append(h)
    return out


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def logit_bf16(h: int, v: int) -> int:
    u = fmix32(h ^ ((v * 0x27D4EB2F) & MASK))
    i = (u >> 8) - 8388608            # signed, in [-2**23, 2**23)
    f = i * 2.0 ** -20                # exact in binary32: |i| < 2**24
    bits = _f32_bits(f)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def logits_bf16(h: int, vocab: int) -> list[int]:
    return [logit_bf16(h, v) for v in range(vocab)]


def bf16_to_float(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (b & 0xFFFF) << 16))[0]


def greedy(row: list[int]) -> int:
    best, best_v = 0, bf16_to_float(row[0])
    for i in range(1, len(row)):
        f = bf16_to_float(row[i])
        if f > best_v:
            best, best_v = i, f
    return best


def generate(prompt: list[int], n_tokens: int, vocab: int) -> list[int]:
    """Greedy tokens: the first from the prompt's last logits, then one per decode. A
    prompt of embedding rows is ``[embed_word(row) for row in rows]``."""
    kv: dict[int, int] = {}
    h = hashes(prompt, 0, kv)[-1]
    out = []
    pos = len(prompt)
    for _ in range(n_tokens):
        tok = greedy(logits_bf16(h, vocab))
        out.append(tok)
        if len(out) == n_tokens:
            break
        h = hashes([tok], pos, kv)[0]
        pos += 1
    return out


def prefill_tile(tokens: list[int], tile_d0: int, vocab: int) -> list[list[int]]:
    """The ``tile_d0`` rows of a prefill output from an empty cache."""
    hs = hashes(tokens)
    start = ((len(tokens) - 1) // tile_d0) * tile_d0
    rows = [logits_bf16(h, vocab) for h in hs[start:]]
    rows += [[0] * vocab for _ in range(tile_d0 - len(rows))]
    return rows
