"""Conformance: the device computes the reference model bit for bit (reference-model.md)."""

from __future__ import annotations

import numpy as np
import pytest

from calfsm.drivers.base import OutputStatus
from calfsm.manifest import TaskKind
from calfsm.testing import refmodel_pure as pure
from calfsm.testing.conformance.util import (
    generate,
    last_row,
    qwen3_calbin,
    run,
    setup,
    small_calbin,
)

DONE_OK = OutputStatus.DONE_OK


def test_fmix32_vectors() -> None:
    # the oracle itself against the spec's table (the drivers are checked against it)
    assert pure.fmix32(1) == 0x514E28B7
    assert pure.fmix32(0xDEADBEEF) == 0x0DE5C6A9
    assert pure.hashes([1, 2, 3]) == [0x8E5E3BA7, 0x792F1B0D, 0x2F6C05BA]


def test_first_logits_after_123_bit_exact(driver) -> None:
    cb = small_calbin(vocab=512)
    driver.configure(cb)
    pre = setup(driver, cb, TaskKind.PREFILL_IDS)
    assert run(driver, pre, 0, [1, 2, 3]) == DONE_OK
    row = last_row(pre, 3)
    assert [int(x) for x in row[:8]] == [0xBFAE, 0xC0DD, 0xC0AE, 0x403F,
                                         0xC065, 0x405B, 0xC032, 0xC00A]
    assert row.tolist() == pure.logits_bf16(0x2F6C05BA, 512)


def test_decode_after_123_uses_kv(driver) -> None:
    cb = small_calbin(vocab=512)
    driver.configure(cb)
    dec = setup(driver, cb, TaskKind.DECODE)
    # three single-token decode jobs build the same chain as one prefill
    for p, t in enumerate([1, 2, 3]):
        assert run(driver, dec, 0, [t], p) == DONE_OK
    assert dec.logits.reshape(-1).tolist() == pure.logits_bf16(0x2F6C05BA, 512)


@pytest.mark.parametrize(("calbin", "prompt", "expected"), [
    (qwen3_calbin, [1, 2, 3], [2730, 142, 62, 2560, 21, 1540, 44, 1445]),
    (lambda: small_calbin(vocab=512), [7], [221, 302, 89, 305, 217, 279, 200, 57]),
    (lambda: small_calbin(vocab=1024), list(range(5, 22)), [207, 250, 694, 177]),
], ids=["qwen3-123", "v512-7", "v1024-5to21"])
def test_greedy_vectors(driver, calbin, prompt, expected) -> None:
    cb = calbin()
    driver.configure(cb)
    pre = setup(driver, cb, TaskKind.PREFILL_IDS)
    dec = setup(driver, cb, TaskKind.DECODE)
    assert generate(driver, pre, dec, 0, prompt, len(expected)) == expected


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 127, 128, 1024])
def test_prefill_tile_rows(driver, n) -> None:
    vocab = 64
    cb = small_calbin(vocab=vocab, max_seq=2048)
    driver.configure(cb)
    pre = setup(driver, cb, TaskKind.PREFILL_IDS)
    pre.logits[...] = 0xAAAA  # garbage: every row must be written
    tokens = [(7 * i + 3) % vocab for i in range(n)]
    assert run(driver, pre, 5, tokens) == DONE_OK
    assert pre.logits.reshape(16, vocab).tolist() == pure.prefill_tile(tokens, 16, vocab)
    h = pure.hashes(tokens)[-1]
    assert last_row(pre, n).tolist() == pure.logits_bf16(h, vocab)


def test_prefill_continues_past_len(driver) -> None:
    vocab = 128
    cb = small_calbin(vocab=vocab, max_seq=256)
    driver.configure(cb)
    pre = setup(driver, cb, TaskKind.PREFILL_IDS)
    tokens = list(range(40))
    assert run(driver, pre, 1, tokens[:23]) == DONE_OK
    assert run(driver, pre, 1, tokens[23:], 23) == DONE_OK
    # the second job's 17 tokens: last chunk is its tokens 16.. -> row 0
    assert last_row(pre, 17).tolist() == pure.logits_bf16(pure.hashes(tokens)[-1], vocab)


def test_decode_chain_matches_pure(driver) -> None:
    vocab = 256
    cb = small_calbin(vocab=vocab, max_seq=512)
    driver.configure(cb)
    pre = setup(driver, cb, TaskKind.PREFILL_IDS)
    dec = setup(driver, cb, TaskKind.DECODE)
    prompt = [11, 22, 33, 44, 55]
    assert generate(driver, pre, dec, 3, prompt, 20) == pure.generate(prompt, 20, vocab)


def test_two_sequences_interleaved_no_cross_talk(driver) -> None:
    vocab = 256
    cb = small_calbin(vocab=vocab, max_seq=512)
    driver.configure(cb)
    pre = setup(driver, cb, TaskKind.PREFILL_IDS)
    dec = setup(driver, cb, TaskKind.DECODE)
    prompts = {10: [1, 2, 3], 20: [9, 8, 7, 6, 5, 4]}
    expected = {s: pure.generate(p, 40, vocab) for s, p in prompts.items()}
    got: dict[int, list[int]] = {}
    pos = {}
    for s, p in prompts.items():
        assert run(driver, pre, s, p) == DONE_OK
        got[s] = [int(np.argmax((last_row(pre, len(p)).astype(np.uint32) << 16)
                                .view(np.float32)))]
        pos[s] = len(p)
    for _ in range(39):
        for s in prompts:
            assert run(driver, dec, s, [got[s][-1]], pos[s]) == DONE_OK
            got[s].append(int(np.argmax((dec.logits.reshape(-1).astype(np.uint32) << 16)
                                        .view(np.float32))))
            pos[s] += 1
    assert got == expected
    assert expected[10] != expected[20]


def test_non_consecutive_positions_read_unwritten_kv_as_zero(driver) -> None:
    vocab = 64
    cb = small_calbin(vocab=vocab, max_seq=64)
    driver.configure(cb)
    dec = setup(driver, cb, TaskKind.DECODE)
    # position 5 of a fresh sequence: reads kv[4], never written -> 0
    assert run(driver, dec, 2, [42], 5) == DONE_OK
    assert dec.logits.reshape(-1).tolist() == pure.logits_bf16(pure.step(0, 42, 5), vocab)


def test_reads_host_memory_at_execution_not_submit(make_driver) -> None:
    from calfsm.drivers.sim import LatencyModel
    d = make_driver(latency=LatencyModel.fixed(decode_s=0.5))
    vocab = 64
    cb = small_calbin(vocab=vocab, max_seq=64)
    d.configure(cb)
    dec = setup(d, cb, TaskKind.DECODE)
    from calfsm.testing.conformance.util import pending, prepare
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    ended_first = not pending(d, dec)
    assert not (ended_first and d.clock.virtual), "a job ended on a virtual clock too early"
    dec.tok[...] = 2           # the host changes its buffer after submit
    assert d.wait(dec.out, 1e6) == 0
    assert d.status(dec.out) == DONE_OK
    got = dec.logits.reshape(-1).tolist()
    old, new = (pure.logits_bf16(pure.step(pure.H_INIT, t, 0), vocab) for t in (1, 2))
    if ended_first:            # a fast device ran it before the change: the old token
        assert got == old
    elif d.clock.virtual:      # it runs later, and reads what the host holds then
        assert got == new
    else:                      # when a real device reads its inputs is spec 14's question
        assert got in (old, new)
