"""CalrtDriver (native emulator, real time) against SimDriver, bit for bit.

For the 100 golden prompts (:func:`calfsm.tools.direct.golden_prompts`, V = 1024 on the tiny
manifest) the prefill logits (the BF16 bits of the row the host reads), four decode steps'
logits and the greedy tokens through :class:`~calfsm.tools.direct.DirectRunner` are the same
on both drivers.
"""

from __future__ import annotations

import numpy as np
import pytest

from calfsm.drivers import refmodel
from calfsm.drivers.calrt import CalrtDriver
from calfsm.drivers.sim import SimDriver
from calfsm.manifest import builtin_manifest
from calfsm.tools.direct import DirectRunner, golden_prompts

DECODE_STEPS = 4


def _trajectory(runner: DirectRunner, seq: int, prompt: list[int]
                ) -> tuple[list[np.ndarray], list[int]]:
    rows = [runner.prefill_bf16(seq, prompt).copy()]
    tokens = [refmodel.greedy(rows[-1])]
    pos = len(prompt)
    for _ in range(DECODE_STEPS):
        rows.append(runner.decode_bf16(seq, tokens[-1], pos).copy())
        tokens.append(refmodel.greedy(rows[-1]))
        pos += 1
    runner.release(seq)
    return rows, tokens


def test_golden_prompts_bit_identical_to_sim() -> None:
    manifest = builtin_manifest("tiny")
    prompts = golden_prompts(100, vocab=manifest.submodels[0].vocab)
    with SimDriver(manifest) as sim, CalrtDriver(manifest) as emu:
        a, b = DirectRunner(sim, manifest), DirectRunner(emu, manifest)
        assert max(map(len, prompts)) == 4096
        for i, prompt in enumerate(prompts):
            rows_a, toks_a = _trajectory(a, i, prompt)
            rows_b, toks_b = _trajectory(b, i, prompt)
            assert toks_a == toks_b, f"prompt {i} (len {len(prompt)})"
            for k, (ra, rb) in enumerate(zip(rows_a, rows_b, strict=True)):
                assert ra.dtype == rb.dtype == np.uint16
                assert np.array_equal(ra, rb), f"prompt {i} step {k}: logits differ"


def test_generate_same_tokens_virtual_time() -> None:
    manifest = builtin_manifest("tiny")
    with SimDriver(manifest) as sim, CalrtDriver.virtual(manifest_or_calbin=manifest) as emu:
        a, b = DirectRunner(sim, manifest), DirectRunner(emu, manifest)
        prompts = golden_prompts(10, vocab=1024, max_len=64, seed=7)
        lengths = {len(p) for p in prompts}
        assert len(lengths) > 3
        for seq, prompt in enumerate(prompts):
            assert a.generate(seq, prompt, 16) == b.generate(seq, prompt, 16)


def test_same_phase_timeline_on_both_drivers() -> None:
    """A mixed ping/pong and serial workload with a transfer share and jitter, a CCU reset
    in the middle: both devices plan every phase alike (to the emulator's nanosecond)."""
    from calfsm.drivers.base import EngineSlot, JobTag, ResetKind
    from calfsm.drivers.sim import LatencyModel
    from calfsm.manifest import TaskKind
    from calfsm.testing.conformance.util import prepare, setup, small_calbin

    cb = small_calbin(vocab=64, max_seq=64)
    lat = LatencyModel.fixed(decode_s=0.01, prefill_per_token_s=1e-3, h2d_s_per_byte=1e-6,
                             d2h_s_per_byte=1e-7, jitter=0.3, transfer_share=0.3)

    def workload(d) -> list[tuple]:
        d.configure(cb)
        pre = setup(d, cb, TaskKind.PREFILL_IDS, engine=EngineSlot.PING)
        dec = setup(d, cb, TaskKind.DECODE, engine=EngineSlot.PONG)
        job = 0
        for parallel in (True, False, True):
            assert d.enable_parallel_mode(parallel) == 0
            for step in range(4):
                seq = 2 * job
                prepare(d, pre, seq, list(range(1, 6 + step)), 0)
                prepare(d, dec, seq + 1, [step + 1], 0)
                for b in (pre, dec):
                    job += 1
                    assert d.infer(b.model, b.inp, b.out, tag=JobTag(job, seq)) == 0
                    if not parallel:
                        assert d.wait(b.out, 10.0) == 0
                for b in (pre, dec):
                    assert d.wait(b.out, 10.0) == 0
            prepare(d, dec, 99, [1], 0)
            assert d.infer(dec.model, dec.inp, dec.out) == 0
            assert d.reset(ResetKind.CCU) == 0      # aborted at once: no phase ran
        return d.timeline()

    with SimDriver(latency=lat) as sim, CalrtDriver.virtual(latency=lat) as emu:
        a, b = workload(sim), workload(emu)
    assert len(a) == 3 * 24
    key = [(s.job, s.engine, s.phase, s.status, s.tag) for s in a]
    assert key == [(s.job, s.engine, s.phase, s.status, s.tag) for s in b]
    # the emulator rounds each phase to a nanosecond, the simulated device does not
    times = [t for s in a for t in (s.start, s.end)]
    assert [t for s in b for t in (s.start, s.end)] == pytest.approx(times, abs=1e-6)
    assert sum(s.start < t.end and t.start < s.end and s.job != t.job and s.engine != t.engine
               for s in a for t in a) > 0          # Ping and Pong did overlap
