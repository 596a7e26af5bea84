"""CalrtDriver (native emulator, real time) against SimDriver, bit for bit.

For the 100 golden prompts (:func:`calfsm.direct.golden_prompts`, V = 1024 on the tiny
manifest) the prefill logits (the BF16 bits of the row the host reads), four decode steps'
logits and the greedy tokens through :class:`~calfsm.direct.DirectRunner` are the same
on both drivers.
"""

from __future__ import annotations

import numpy as np

from calfsm import refmodel
from calfsm.direct import DirectRunner, golden_prompts
from calfsm.drivers.calrt import CalrtDriver
from calfsm.drivers.sim import SimDriver
from calfsm.manifest import builtin_manifest

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
