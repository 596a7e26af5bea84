"""calfsm.llama on a batch calbin (issue 22, item 6): a ``llama_batch`` holding several
sequences becomes one device job per step where the executor batches, instead of -1.

Every sequence's tokens and logits are compared with the reference model (a fresh
simulated device per prompt); the device's own steps (an observer of ``device_step``)
show the sequences' decodes shared one job. On a batch-1 calbin the same batch is still
-1 (tests/llama/test_llama.py, "two sequences").
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.llama import ABORTED, NO_KV_SLOT, SUCCESS, LlamaBatch, LlamaContext
from calfsm.manifest import TaskKind
from calfsm.tools.direct import DirectRunner, golden_prompts
from tests.helpers.batching import batch_sizes, make_batched
from tests.helpers.executor import TINY

PROMPTS = [list(p) for p in golden_prompts()[:4]]
N_SEQ = len(PROMPTS)

pytestmark = pytest.mark.timeout(120)


def reference(prompt: list[int], n: int) -> list[int]:
    with SimDriver(TINY) as d:
        return DirectRunner(d, TINY).generate(0, prompt, n)


def reference_row(prompt: list[int]) -> np.ndarray:
    with SimDriver(TINY) as d:
        return DirectRunner(d, TINY).prefill(0, prompt).copy()


def prompts_batch(prompts: list[list[int]]) -> LlamaBatch:
    """Every prompt on its own sequence, its last token flagged (llama.cpp's parallel
    example)."""
    batch = LlamaBatch()
    for s, prompt in enumerate(prompts):
        for i, token in enumerate(prompt):
            batch.add(token, i, [s], i == len(prompt) - 1)
    return batch


def parallel_greedy(ctx: LlamaContext, prompts: list[list[int]], n: int) -> list[list[int]]:
    """llama.cpp's ``parallel`` loop: the prompts in one batch, then one token of every
    sequence per batch, each batch one decode."""
    assert ctx.decode(prompts_batch(prompts)) == SUCCESS
    out: list[list[int]] = [[] for _ in prompts]
    last = {s: len(p) - 1 for s, p in enumerate(prompts)}
    order = [prompts_batch(prompts).n_tokens - 1 - sum(len(q) for q in prompts[s + 1:])
             for s in range(len(prompts))]       # batch index of each prompt's last token
    for _ in range(n):
        batch = LlamaBatch()
        for s in range(len(prompts)):
            token = int(np.argmax(ctx.get_logits_ith(order[s])))
            out[s].append(token)
            last[s] += 1
            batch.add(token, last[s], [s], True)
        order = list(range(len(prompts)))
        assert ctx.decode(batch) == SUCCESS
    return out


@pytest.mark.parametrize("device", ["sim", "emulator"])
def test_several_sequences_in_one_batch_give_the_reference_and_share_steps(
        mode, device, tmp_path):
    want = [reference(p, 8) for p in PROMPTS]
    with make_batched(mode, tmp_path, device=device) as ex, \
            LlamaContext(ex, n_seq_max=N_SEQ, n_outputs_max=N_SEQ) as ctx:
        assert ctx.multi_sequence
        assert parallel_greedy(ctx, PROMPTS, 8) == want
        for s, prompt in enumerate(PROMPTS):
            assert ctx.memory.seq_pos_max(s) == len(prompt) + 8 - 1
        sizes = batch_sizes(ex)
        assert max(sizes) > 1, f"no decode step carried two sequences: {sizes}"
        if mode == "step":        # all four decodes queued before the scheduler runs
            assert sizes[N_SEQ] >= 7, sizes


def test_interleaved_tokens_of_several_sequences_each_go_on_in_batch_order(tmp_path):
    a, b = PROMPTS[0], PROMPTS[1]
    with make_batched("step", tmp_path) as ex, \
            LlamaContext(ex, n_seq_max=2, n_outputs_max=2) as ctx:
        batch = LlamaBatch()
        for i in range(max(len(a), len(b))):      # a0 b0 a1 b1 ...
            for s, p in ((0, a), (1, b)):
                if i < len(p):
                    batch.add(p[i], i, [s], i == len(p) - 1)
        result = ctx.decode_sync(batch)
        assert result.seq_ids == (0, 1) and len(result.outputs) == 2
        assert [ctx.memory.seq_pos_max(s) for s in (0, 1)] == [len(a) - 1, len(b) - 1]
        want = {0: reference_row(a), 1: reference_row(b)}
        for k, i in enumerate(result.outputs):     # rows in batch order
            seq = batch.seq_id[i][0]
            assert np.array_equal(ctx.get_logits_ith(i), want[seq]), f"sequence {seq}"
            assert np.array_equal(ctx.get_logits()[k], want[seq])


def test_positions_of_each_sequence_are_checked_apart(tmp_path):
    with make_batched("step", tmp_path) as ex, \
            LlamaContext(ex, n_seq_max=2, n_outputs_max=2) as ctx:
        assert ctx.decode(LlamaBatch.get_one([5, 6])) == SUCCESS      # sequence 0 holds 2
        bad = LlamaBatch(token=[7, 8], pos=[2, 1], seq_id=[[0], [1]])   # 1 must be 0
        accepted = ex.stats().accepted
        assert ctx.decode(bad) == -1 and ex.stats().accepted == accepted
        good = LlamaBatch(token=[7, 8], pos=[2, 0], seq_id=[[0], [1]], logits=[1, 1])
        assert ctx.decode(good) == SUCCESS
        assert (ctx.memory.seq_pos_max(0), ctx.memory.seq_pos_max(1)) == (2, 0)
        assert np.array_equal(ctx.get_logits_ith(0), reference_row([5, 6, 7]))
        assert np.array_equal(ctx.get_logits_ith(1), reference_row([8]))
        one_token_two_seqs = LlamaBatch(token=[1], n_seq_id=[2], seq_id=[[0, 1]])
        assert ctx.decode(one_token_two_seqs) == -1


def test_no_kv_room_for_one_sequence_is_one_and_restores_every_sequence(tmp_path, caplog):
    """Sequence 1's decode never gets KV (its admission deadline passes): 1, and what
    sequence 0 committed in the same call is truncated away too (llama.cpp: after 1 the
    memory is as before the call)."""
    faults = FaultPlan.of(FaultRule("kv_apply", "refuse", seq_id=1, nth=2, every=1))
    with make_batched("step", tmp_path, faults=faults) as ex, \
            LlamaContext(ex, n_seq_max=2, n_outputs_max=2) as ctx:
        assert ctx.memory.seq_ids == (0, 1)
        assert ctx.decode(prompts_batch(PROMPTS[:2])) == SUCCESS
        held = [ctx.memory.seq_pos_max(s) for s in (0, 1)]
        batch = LlamaBatch(token=[3, 4, 5, 6], seq_id=[[0], [1], [0], [1]],
                           logits=[0, 0, 1, 1])
        with caplog.at_level(logging.WARNING, logger="calfsm"):
            assert ctx.decode(batch) == NO_KV_SLOT
        errors = [r for r in caplog.records if getattr(r, "error", None)]
        assert [(r.error, r.stage, r.seq_id) for r in errors] == \
            [("DeadlineExceeded", "admission", 1)]
        assert [ctx.memory.seq_pos_max(s) for s in (0, 1)] == held
        assert ex.driver.kv_allocated(0) == held[0] + 1
        assert ctx.get_logits().shape[0] == 0
        assert ctx.decode(LlamaBatch(token=[3, 5], seq_id=[[0], [0]])) == SUCCESS
        assert np.array_equal(ctx.get_logits_ith(1), reference_row([*PROMPTS[0], 3, 5]))


def test_abort_stops_every_sequence_and_keeps_what_was_processed(tmp_path):
    with make_batched("step", tmp_path) as ex, \
            LlamaContext(ex, n_seq_max=2, n_outputs_max=4) as ctx:
        asked: list[int] = []
        ctx.set_abort_callback(lambda: asked.append(1) or len(asked) > 1)
        batch = LlamaBatch(token=[3, 4, 5, 6], seq_id=[[0], [1], [0], [1]],
                           logits=[1, 1, 1, 1])
        assert ctx.decode(batch) == ABORTED
        assert [ctx.memory.seq_pos_max(s) for s in (0, 1)] == [0, 0]    # round one stays
        assert np.array_equal(ctx.get_logits_ith(0), reference_row([3]))
        assert np.array_equal(ctx.get_logits_ith(1), reference_row([4]))
        assert ctx.get_logits().shape[0] == 2
        ctx.set_abort_callback(None)
        assert ctx.decode(LlamaBatch(token=[5, 6], seq_id=[[0], [1]],
                                     pos=[1, 1], logits=[1, 1])) == SUCCESS


def test_without_batch_evidence_the_batch_still_runs_one_row_per_job(tmp_path):
    want = [reference(p, 3) for p in PROMPTS]
    with make_batched("step", tmp_path, evidence=False) as ex, \
            LlamaContext(ex, n_seq_max=N_SEQ, n_outputs_max=N_SEQ) as ctx:
        assert ex.max_batch == 1 and ex.health().notes
        assert parallel_greedy(ctx, PROMPTS, 3) == want
        assert set(batch_sizes(ex)) == {1}
        assert ex.epoch.contract(TaskKind.DECODE).max_batch == 8
