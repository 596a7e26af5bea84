"""calfsm.llama: llama.cpp's batch, return codes, logits and memory on the executor.

Every token and logit is compared with the reference model (``DirectRunner`` on a fresh
simulated device, or the documented test vectors); every return code is produced by the
fault or the bad input that should produce it.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import threading
from pathlib import Path

import attrs
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calfsm.drivers.calrt import CalrtDriver
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.engine.recovery import RecoveryPolicy
from calfsm.errors import (
    CalfsmError,
    Cancelled,
    DeadlineExceeded,
    ErrorCategory,
    ExecutorClosed,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    Unsupported,
)
from calfsm.generate.processors import ban_tokens, logit_bias
from calfsm.generate.sampling import SamplingParams
from calfsm.llama import (
    ABORTED,
    DEVICE_FAILED,
    EXECUTOR_UNUSABLE,
    INVALID_INPUT,
    KV_OPERATIONS,
    NO_KV_SLOT,
    RETURN_CODES,
    SUCCESS,
    LlamaBatch,
    LlamaContext,
    LlamaMemory,
    SamplerChain,
    decode,
    decode_sync,
    return_code,
)
from calfsm.llama.codes import render_table
from calfsm.manifest import TaskKind
from calfsm.request import Request
from calfsm.tools.direct import DirectRunner
from tests.helpers.executor import (
    TINY,
    GatedDriver,
    drive,
    make_executor,
    make_sim,
    reference_stream,
)
from tests.helpers.streams import direct_runner

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 1024
PROMPT = [5, 9, 100, 7, 3, 811, 42, 17, 256, 1]


def reference(prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the reference model after ``prompt`` (a fresh device)."""
    with SimDriver(TINY) as d:
        return DirectRunner(d, TINY).generate(0, prompt, n)


def reference_rows(prompt: list[int]) -> list[np.ndarray]:
    """The float32 logits after each prefix ``prompt[:k+1]``."""
    with SimDriver(TINY) as d:
        runner = DirectRunner(d, TINY)
        rows = []
        for k in range(len(prompt)):
            rows.append(runner.prefill(0, prompt[:k + 1]).copy())
            runner.release(0)
        return rows


def greedy_loop(ctx: LlamaContext, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's simple example: decode the prompt, then one sampled token at a time."""
    batch, out = LlamaBatch.get_one(prompt), []
    for _ in range(n):
        assert ctx.decode(batch) == SUCCESS
        out.append(int(np.argmax(ctx.get_logits_ith(-1))))
        batch = LlamaBatch.get_one([out[-1]])
    return out


def emulator(mode: str) -> CalrtDriver:
    if mode == "step":
        return CalrtDriver.virtual(manifest_or_calbin=TINY)
    return CalrtDriver(TINY, latency=LatencyModel.zero())


def recovered(ex, generation: int) -> None:
    """Drive until the executor is Ready on a later generation than ``generation``."""
    drive(ex, lambda: ex.generation > generation and ex.lifecycle_state == "Ready")


def failure_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Log records that carry an error's context (one per failure)."""
    return [r for r in caplog.records if hasattr(r, "error")]


# ---- decoding gives the reference model's tokens ------------------------------------

@pytest.mark.parametrize("device", ["sim", "emulator"])
def test_greedy_loop_gives_the_reference_tokens(mode, device):
    driver = make_sim(mode) if device == "sim" else emulator(mode)
    with make_executor(mode, driver=driver) as ex, LlamaContext(ex) as ctx:
        assert greedy_loop(ctx, PROMPT, 8) == reference(PROMPT, 8)
        assert ctx.memory.seq_pos_max(0) == len(PROMPT) + 6
        assert decode(ctx, LlamaBatch.get_one([1])) == SUCCESS


def test_flagged_tokens_get_their_logits_in_the_callers_buffer():
    rows = reference_rows(PROMPT)
    flagged = (0, 3, 4, 9)
    out = np.full((4, VOCAB), np.nan, np.float32)
    with make_executor("step") as ex, LlamaContext(ex, n_outputs_max=4, logits=out) as ctx:
        batch = LlamaBatch(token=PROMPT, pos=list(range(10)), n_seq_id=[1] * 10,
                           seq_id=[[0]] * 10, logits=[int(i in flagged) for i in range(10)])
        res = decode_sync(ctx, batch)
        assert res.outputs == flagged and len(res.jobs) == 4   # one job per output
        for k, i in enumerate(flagged):
            got = ctx.get_logits_ith(i)
            assert np.shares_memory(got, out) and np.array_equal(got, rows[i])
            assert np.array_equal(ctx.get_logits()[k], rows[i])
            assert np.shares_memory(res.jobs[k].logits, out)
        assert np.array_equal(ctx.get_logits_ith(-1), rows[9])
        assert np.array_equal(ctx.get_logits_ith(-4), rows[0])
        for i in (1, 2, 8, -5):
            with pytest.raises(InvalidArgument, match=r"no logits|no output"):
                ctx.get_logits_ith(i)


@settings(max_examples=15)
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       data=st.data(), n_ubatch=st.integers(1, 5))
def test_any_flags_and_ubatch_size_give_the_reference_rows(prompt, data, n_ubatch):
    flags = data.draw(st.lists(st.booleans(), min_size=len(prompt), max_size=len(prompt)))
    rows, want = reference_rows(prompt), [i for i, f in enumerate(flags) if f]
    with make_executor("step") as ex, \
            LlamaContext(ex, n_outputs_max=len(prompt), n_ubatch=n_ubatch) as ctx:
        res = ctx.decode_sync(LlamaBatch(token=prompt, logits=flags))
        assert list(res.outputs) == want
        assert all(j.token_count <= n_ubatch for j in res.jobs)
        assert sum(j.token_count for j in res.jobs) == len(prompt)
        for i in want:
            assert np.array_equal(ctx.get_logits_ith(i), rows[i])
        assert ctx.memory.seq_pos_max(0) == len(prompt) - 1


def test_one_token_prompt_runs_on_the_decode_graph():
    with make_executor("step") as ex, LlamaContext(ex) as ctx:
        assert ctx.decode_sync(LlamaBatch.get_one([7])).jobs[0].kind is TaskKind.DECODE
        assert ctx.memory.seq_rm(0, -1, -1)
        assert greedy_loop(ctx, [7], 5) == reference([7], 5)


def test_a_batch_without_flags_runs_and_has_no_logits():
    with make_executor("step") as ex, LlamaContext(ex) as ctx:
        assert ctx.decode(LlamaBatch(token=PROMPT[:6], logits=[0] * 6)) == SUCCESS
        assert ctx.get_logits().shape == (0, VOCAB)
        assert ctx.memory.seq_pos_max(0) == 5
        assert ctx.decode(LlamaBatch.get_one(PROMPT[6:])) == SUCCESS
        assert int(np.argmax(ctx.get_logits_ith(-1))) == reference(PROMPT, 1)[0]


def test_long_batch_is_cut_into_ubatches_of_n_ubatch():
    prompt = (PROMPT * 4)[:37]
    with make_executor("step") as ex, LlamaContext(ex, n_ubatch=16) as ctx:
        res = ctx.decode_sync(LlamaBatch.get_one(prompt))
        assert [j.token_count for j in res.jobs] == [16, 16, 5]
        assert int(np.argmax(ctx.get_logits_ith(-1))) == reference(prompt, 1)[0]


def test_embeddings_batch_gives_the_documented_tokens():
    """docs/reference-model.md: 17 x 64 BF16 rows e[i][j] = ((64 i + j) mod 23 - 11) / 4
    then greedy decoding, V = 1024 -> 376 848 510 852."""
    i, j = np.meshgrid(np.arange(17), np.arange(64), indexing="ij")
    embd = (((64 * i + j) % 23 - 11) / 4).astype(ml_dtypes.bfloat16)
    with make_executor("step") as ex, LlamaContext(ex) as ctx:
        assert ctx.decode(LlamaBatch(embd=embd)) == SUCCESS
        out = [int(np.argmax(ctx.get_logits_ith(-1)))]
        for _ in range(3):
            assert ctx.decode(LlamaBatch.get_one([out[-1]])) == SUCCESS
            out.append(int(np.argmax(ctx.get_logits_ith(-1))))
    assert out == [376, 848, 510, 852]


def test_sequences_of_one_context_are_apart():
    with make_executor("step") as ex, LlamaContext(ex, n_seq_max=2) as ctx:
        other = [3, 1, 4, 1, 5]
        b = LlamaBatch()
        for p, t in enumerate(other):
            b.add(t, p, [1], p == len(other) - 1)
        assert ctx.decode(b) == SUCCESS
        assert int(np.argmax(ctx.get_logits_ith(4))) == reference(other, 1)[0]
        assert greedy_loop(ctx, PROMPT, 4) == reference(PROMPT, 4)
        numpy_fields = LlamaBatch(token=np.array([2]), pos=np.array([5]),
                                  n_seq_id=np.array([1]), seq_id=np.array([[1]]),
                                  logits=np.array([True]))
        assert ctx.decode(numpy_fields) == SUCCESS
        assert int(np.argmax(ctx.get_logits_ith(0))) == reference([*other, 2], 1)[0]
        assert (ctx.memory.seq_pos_max(0), ctx.memory.seq_pos_max(1)) == (12, 5)
        b.clear()
        assert b.n_tokens == 0 and ctx.decode(b) == INVALID_INPUT


# ---- the sampler chain -------------------------------------------------------------

def chain_loop(ctx: LlamaContext, chain: SamplerChain, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's loop with a sampler chain: ``llama_sampler_sample(chain, ctx, -1)``."""
    batch, out = LlamaBatch.get_one(prompt), []
    for _ in range(n):
        assert ctx.decode(batch) == SUCCESS
        out.append(chain.sample(ctx, -1))
        batch = LlamaBatch.get_one([out[-1]])
    return out


def no_repeat(tokens, row) -> None:
    row[tokens[-1]] = -np.inf


@pytest.mark.parametrize("params", [
    SamplingParams(logits_processors=[logit_bias({7: 3.0}), ban_tokens(range(0, VOCAB, 2)),
                                      no_repeat]),
    SamplingParams(temperature=0.9, top_k=30, seed=4,
                   logits_processors=[ban_tokens(range(0, VOCAB, 2)), no_repeat]),
], ids=["greedy", "dist"])
def test_a_sampler_chain_applies_its_processors_then_chooses(mode, params):
    """The chain's tokens are the reference rows sampled after the processors (which
    see the prompt and the accepted tokens); no banned token, no repeat; ``reset``
    starts the draw from its seed again."""
    want = reference_stream(direct_runner(), PROMPT,
                            attrs.evolve(params, max_tokens=8))
    with make_executor(mode) as ex, LlamaContext(ex) as ctx:
        chain = SamplerChain(params, ctx.n_vocab, prompt=PROMPT)
        got = chain_loop(ctx, chain, PROMPT, 8)
        assert got == want and chain.tokens == (*PROMPT, *got)
        assert all(t % 2 for t in got) and all(a != b for a, b in itertools.pairwise(got))
        chain.reset()
        assert chain.tokens == tuple(PROMPT)
        assert ctx.memory.seq_rm(0, -1, -1)
        assert chain_loop(ctx, chain, PROMPT, 8) == want
        chain.accept(3)                     # what a caller forces joins the history
        assert chain.tokens == (*PROMPT, *want, 3)


def test_a_sampler_chain_checks_its_arguments():
    with make_executor("step") as ex, LlamaContext(ex) as ctx:
        with pytest.raises(InvalidArgument, match="SamplingParams"):
            SamplerChain({"temperature": 0}, VOCAB)
        with pytest.raises(InvalidArgument, match=r"logits_processors\[0\]"):
            SamplerChain(SamplingParams(logits_processors=[ban_tokens([VOCAB])]), VOCAB)
        chain = SamplerChain(SamplingParams(), VOCAB)
        for bad in (-1, VOCAB, 1.0, True):
            with pytest.raises(InvalidArgument, match="token"):
                chain.accept(bad)
        with pytest.raises(InvalidArgument, match="vocabulary of 512"):
            SamplerChain(SamplingParams(), 512).sample(ctx)
        with pytest.raises(InvalidArgument, match="no output"):
            chain.sample(ctx)                       # nothing decoded yet


# ---- the return codes --------------------------------------------------------------

def test_every_category_has_a_code_and_the_docs_hold_the_table():
    for category in ErrorCategory:
        assert return_code(CalfsmError("probe", category=category)) in (
            NO_KV_SLOT, INVALID_INPUT, EXECUTOR_UNUSABLE, DEVICE_FAILED)
    assert return_code(Cancelled("x")) == ABORTED
    assert return_code(ResourceExhausted("x")) == NO_KV_SLOT
    assert return_code(DeadlineExceeded("x", stage="admission")) == NO_KV_SLOT
    assert return_code(DeadlineExceeded("x", stage="wait")) == DEVICE_FAILED
    assert return_code(ExecutorClosed("x")) == EXECUTOR_UNUSABLE
    assert all(rule.code != SUCCESS for rule in RETURN_CODES)
    assert render_table() in (ROOT / "docs" / "llama.md").read_text("utf-8")


BAD_BATCHES = {
    "token outside the vocabulary": LlamaBatch(token=[1, VOCAB]),
    "negative token": LlamaBatch(token=[-1]),
    "float token": LlamaBatch(token=[1.0]),
    "bool token": LlamaBatch(token=[True]),
    "no tokens": LlamaBatch(token=[]),
    "token not a sequence": LlamaBatch(token=5),
    "embeddings not an array": LlamaBatch(embd=[[0.0] * 64]),
    "tokens and embeddings": LlamaBatch(token=[1], embd=np.zeros((1, 64), np.float32)),
    "embeddings of the wrong dtype": LlamaBatch(embd=np.zeros((2, 64), np.float32)),
    "embeddings of the wrong width": LlamaBatch(
        embd=np.zeros((2, 63), ml_dtypes.bfloat16)),
    "positions not from what the sequence holds": LlamaBatch(token=[1, 2], pos=[1, 2]),
    "positions with a gap": LlamaBatch(token=[1, 2, 3], pos=[0, 1, 3]),
    "positions of the wrong length": LlamaBatch(token=[1, 2], pos=[0]),
    "two sequences": LlamaBatch(token=[1, 2], seq_id=[[0], [1]]),
    "a token of two sequences": LlamaBatch(token=[1], n_seq_id=[2], seq_id=[[0, 1]]),
    "a sequence the context does not have": LlamaBatch(token=[1], seq_id=[[3]]),
    "a logits flag of 2": LlamaBatch(token=[1, 2], logits=[0, 2]),
    "flags of the wrong length": LlamaBatch(token=[1, 2], logits=[1]),
    "more outputs than rows": LlamaBatch(token=[1, 2, 3], logits=[1, 1, 1]),
    "past max_seq": LlamaBatch(token=[1] * 8193),
}


@pytest.mark.parametrize("name", BAD_BATCHES)
def test_invalid_input_is_minus_one_runs_nothing_and_is_logged_once(name, caplog):
    with make_executor("step") as ex, LlamaContext(ex, n_seq_max=2, n_outputs_max=2) as ctx:
        assert ctx.decode(LlamaBatch.get_one([7, 8])) == SUCCESS
        accepted = ex.stats().accepted
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="calfsm"):
            assert ctx.decode(BAD_BATCHES[name]) == INVALID_INPUT
        [rec] = failure_records(caplog)
        assert rec.llama_code == INVALID_INPUT and rec.stage in ("llama_batch", "request")
        assert ex.stats().accepted == accepted, "a bad batch must run nothing"
        assert ctx.memory.seq_pos_max(0) == 1 and ctx.get_logits().shape[0] == 0
        with pytest.raises(InvalidArgument):
            decode_sync(ctx, BAD_BATCHES[name])


def test_not_a_batch_is_invalid_input():
    with make_executor("step") as ex, LlamaContext(ex) as ctx:
        assert ctx.decode([1, 2, 3]) == INVALID_INPUT


def test_token_budget_too_small_is_one_and_a_smaller_batch_then_succeeds():
    with make_executor("step", token_budget=4) as ex, LlamaContext(ex) as ctx:
        with pytest.raises(ResourceExhausted):
            ctx.decode_sync(LlamaBatch.get_one(PROMPT[:6]))
        assert ctx.decode(LlamaBatch.get_one(PROMPT[:6])) == NO_KV_SLOT
        assert ctx.memory.seq_pos_max(0) == -1
        for part in (PROMPT[:3], PROMPT[3:6]):             # retry smaller
            assert ctx.decode(LlamaBatch.get_one(part)) == SUCCESS
        assert int(np.argmax(ctx.get_logits_ith(-1))) == reference(PROMPT[:6], 1)[0]


def test_no_kv_room_for_a_later_ubatch_is_one_and_restores_the_sequence(caplog):
    """The second job of the batch never gets KV (its admission deadline passes): 1, and
    what the first job committed is truncated away, as llama.cpp promises for 1."""
    faults = FaultPlan.of(FaultRule("kv_apply", "refuse", seq_id=0, nth=2, every=1))
    with make_executor("step", faults=faults) as ex, \
            LlamaContext(ex, n_outputs_max=2) as ctx:
        batch = LlamaBatch(token=PROMPT[:5], logits=[0, 1, 0, 0, 1])
        with caplog.at_level(logging.WARNING, logger="calfsm"):
            assert ctx.decode(batch) == NO_KV_SLOT
        [rec] = failure_records(caplog)
        assert (rec.error, rec.stage, rec.seq_id) == ("DeadlineExceeded", "admission", 0)
        assert rec.job_id is not None and rec.generation == ex.generation
        assert ctx.memory.seq_pos_max(0) == -1 and ex.driver.kv_allocated(0) == 0
        assert ctx.get_logits().shape[0] == 0


def test_device_busy_at_submit_is_one_and_the_retry_succeeds(mode, caplog):
    faults = FaultPlan.of(FaultRule("infer", "code", seq_id=0))     # DEVICE_BUSY, once
    with make_executor(mode, faults=faults) as ex, LlamaContext(ex) as ctx:
        with caplog.at_level(logging.WARNING, logger="calfsm"):
            assert ctx.decode(LlamaBatch.get_one(PROMPT)) == NO_KV_SLOT
        [rec] = failure_records(caplog)
        assert (rec.calrt_code, rec.stage, rec.seq_id) == (17, "submit", 0)
        assert ctx.memory.seq_pos_max(0) == -1
        drive(ex, lambda: ex.faults.backoff_until <= ex.clock.now())
        assert greedy_loop(ctx, PROMPT, 3) == reference(PROMPT, 3)


def test_abort_callback_is_two_and_keeps_what_was_processed(caplog):
    rows = reference_rows(PROMPT[:6])
    with make_executor("step") as ex, LlamaContext(ex, n_outputs_max=2) as ctx:
        asked = []
        ctx.set_abort_callback(lambda: asked.append(1) or len(asked) > 1)
        batch = LlamaBatch(token=PROMPT[:6], logits=[0, 0, 1, 0, 0, 1])
        with caplog.at_level(logging.WARNING, logger="calfsm"):
            assert ctx.decode(batch) == ABORTED
        [rec] = failure_records(caplog)
        assert (rec.error, rec.llama_code, rec.seq_id) == ("Cancelled", ABORTED, 0)
        assert ctx.memory.seq_pos_max(0) == 2                # the first ubatch stays
        assert np.array_equal(ctx.get_logits_ith(2), rows[2])
        with pytest.raises(InvalidArgument):
            ctx.get_logits_ith(5)
        ctx.set_abort_callback(None)
        assert ctx.decode(LlamaBatch.get_one(PROMPT[3:6])) == SUCCESS
        assert np.array_equal(ctx.get_logits_ith(-1), rows[5])


def test_abort_before_a_job_is_submitted_runs_nothing_more():
    with make_executor("step") as ex, LlamaContext(ex, n_outputs_max=2) as ctx:
        calls = []
        # the callback aborts through abort() and lets the ubatch go on to its enqueue
        ctx.set_abort_callback(lambda: (calls.append(1), len(calls) == 2 and ctx.abort()
                                        and False)[1])
        assert ctx.decode(LlamaBatch(token=PROMPT[:4], logits=[0, 1, 0, 1])) == ABORTED
        assert ex.stats().cancelled == 1 and ctx.memory.seq_pos_max(0) == 1
        assert len(calls) == 2
        ctx.set_abort_callback(None)
        assert not ctx.abort()                                  # no decode running
        assert ctx.decode(LlamaBatch.get_one(PROMPT[2:4])) == SUCCESS


def test_abort_from_another_thread_cancels_the_job_in_flight(caplog):
    driver = GatedDriver(make_sim("threaded"))
    with make_executor("threaded", driver=driver) as ex, \
            LlamaContext(ex, n_outputs_max=2) as ctx:
        assert not ctx.abort()                               # nothing running
        driver.gate.clear()
        accepted = ex.stats().accepted
        two_ubatches = LlamaBatch(token=PROMPT, logits=[0, 0, 0, 0, 1, 0, 0, 0, 0, 1])
        codes: list[int] = []
        worker = threading.Thread(target=lambda: codes.append(ctx.decode(two_ubatches)))
        with caplog.at_level(logging.WARNING, logger="calfsm"):
            worker.start()
            assert driver.waiting.wait(10)
            assert ctx.abort()
            driver.gate.set()
            worker.join(10)
        assert codes == [ABORTED]
        [rec] = failure_records(caplog)
        assert rec.error == "Cancelled" and rec.job_id is not None
        # cancelled after submit: the job ran and its KV stays, as llama.cpp says for 2;
        # the second ubatch never ran
        assert ctx.memory.seq_pos_max(0) == 4 and ex.stats().accepted == accepted + 1
        assert ctx.get_logits().shape[0] == 0


FATAL_FAULTS = {
    "ccu exception": (FaultRule("infer", "ccu_exception", seq_id=0), "Unavailable", None),
    "NaN logits": (FaultRule("infer", "nan", seq_id=0, index=3), "Internal", None),
    "execution deadline": (FaultRule("infer", "hang", seq_id=0), "DeadlineExceeded", 13),
    "device unavailable at submit": (
        FaultRule("infer", "code", seq_id=0, code=18), "Unavailable", 18),
}


@pytest.mark.parametrize("name", FATAL_FAULTS)
def test_device_failure_is_fatal_and_the_sequence_starts_again(mode, name, caplog):
    rule, error, calrt = FATAL_FAULTS[name]
    quick = {"execution_timeout_s": 0.2, "recovery": RecoveryPolicy(grace_period_s=0.05)}
    with make_executor(mode, faults=FaultPlan.of(rule), **quick) as ex, \
            LlamaContext(ex) as ctx:
        g0 = ex.generation
        with caplog.at_level(logging.WARNING, logger="calfsm"):
            assert ctx.decode(LlamaBatch.get_one(PROMPT)) == DEVICE_FAILED
            [rec] = [r for r in failure_records(caplog) if r.job_id is not None]
            assert failure_records(caplog) == [rec], "one failure, one log line"
        assert (rec.error, rec.seq_id, rec.generation, rec.calrt_code) == (
            error, 0, g0, calrt)
        recovered(ex, g0)
        # the reset lost the KV: the sequence holds nothing and starts again at 0
        assert ctx.memory.seq_pos_max(0) == -1
        assert ctx.decode(LlamaBatch(token=[1], pos=[3])) == INVALID_INPUT
        assert greedy_loop(ctx, PROMPT, 4) == reference(PROMPT, 4)


def test_a_recovering_device_is_fatal(caplog):
    with make_executor("step") as ex, LlamaContext(ex) as ctx:
        assert ctx.decode(LlamaBatch.get_one(PROMPT)) == SUCCESS
        assert ex.recover("operator restart")
        with caplog.at_level(logging.WARNING, logger="calfsm.llama"):
            assert ctx.decode(LlamaBatch.get_one([1])) == DEVICE_FAILED
        [rec] = failure_records(caplog)
        assert rec.error == "Unavailable" and rec.stage == "admission"
        with pytest.raises(Unavailable):
            ctx.decode_sync(LlamaBatch.get_one([1]))


def test_a_closed_executor_is_fatal_for_the_executor():
    ex = make_executor("step")
    ctx = LlamaContext(ex)
    ex.close()
    assert ctx.decode(LlamaBatch.get_one([1])) == EXECUTOR_UNUSABLE
    with pytest.raises(ExecutorClosed):
        ctx.decode_sync(LlamaBatch.get_one([1]))
    ctx.close()


# ---- the memory --------------------------------------------------------------------

def _sample_args(name: str) -> tuple:
    return {"seq_cp": (0, 1, -1, -1), "seq_keep": (0,), "seq_add": (0, 0, -1, 2),
            "seq_div": (0, 0, -1, 2)}.get(name, ())


def test_every_unsupported_operation_raises_and_the_capabilities_match():
    supported = {k for k, why in KV_OPERATIONS.items() if why is None}
    assert set(LlamaMemory.capabilities()) == supported == {
        "clear", "seq_rm", "seq_pos_min", "seq_pos_max", "can_shift"}
    with make_executor("step") as ex, LlamaContext(ex, n_seq_max=2) as ctx:
        assert ctx.decode(LlamaBatch.get_one(PROMPT)) == SUCCESS
        mem = ctx.memory
        for name, why in KV_OPERATIONS.items():
            assert mem.supports(name) is (why is None)
            if why is None:
                continue
            with pytest.raises(Unsupported) as info:
                getattr(mem, name)(*_sample_args(name))
            assert why in str(info.value) and info.value.http_status == 501
            assert not info.value.retryable
        assert mem.seq_pos_max(0) == len(PROMPT) - 1, "an unsupported call changed the KV"
        assert not mem.can_shift() and mem.seq_pos_min(0) == 0 and mem.seq_pos_min(1) == -1
        assert not mem.supports("seq_shift_everything")


@pytest.mark.parametrize("device", ["sim", "emulator"])
def test_removing_a_tail_then_going_on_equals_a_fresh_shorter_prompt(mode, device):
    """Prompt, three generated tokens, then seq_rm of everything from position 6 and a
    different continuation: the tokens equal a fresh run of prompt[:6] + continuation,
    on the simulated device and the native emulator (the device KV from position 6 on
    is written again by the next prefill; position 5 is what it reads)."""
    driver = make_sim(mode) if device == "sim" else emulator(mode)
    shorter = [*PROMPT[:6], 99, 500]
    with make_executor(mode, driver=driver) as ex, LlamaContext(ex) as ctx:
        greedy_loop(ctx, PROMPT, 4)
        dev = ctx.memory.seq_ids[0]
        assert ex.epoch.kv.sequence_length(dev) == len(PROMPT) + 3
        assert ctx.memory.seq_rm(0, 6, -1)
        assert ctx.memory.seq_pos_max(0) == 5 == ex.epoch.kv.sequence_length(dev) - 1
        if device == "sim":
            assert ex.driver.kv_allocated(dev) == 6         # the tail's KV is given back
        assert ctx.decode(LlamaBatch(token=[1], pos=[10])) == INVALID_INPUT
        assert greedy_loop(ctx, [99, 500], 6) == reference(shorter, 6)


def test_seq_rm_of_a_hole_or_the_head_is_refused_and_changes_nothing():
    with make_executor("step") as ex, LlamaContext(ex) as ctx:
        assert ctx.decode(LlamaBatch.get_one(PROMPT)) == SUCCESS
        mem = ctx.memory
        assert not mem.seq_rm(0, 2, 5) and not mem.seq_rm(0, 0, 4)
        assert mem.seq_rm(0, 20, -1) and mem.seq_rm(0, 4, 4)    # nothing held there
        assert mem.seq_pos_max(0) == len(PROMPT) - 1
        assert mem.seq_rm(0, 4, 100)                          # a tail, p1 past the end
        assert mem.seq_pos_max(0) == 3
        with pytest.raises(InvalidArgument):
            mem.seq_rm(1, -1, -1)
        with pytest.raises(InvalidArgument):
            mem.seq_rm(0, 1.5, -1)


def test_clearing_releases_the_kv_and_the_sequence_starts_at_zero():
    with make_executor("step") as ex, LlamaContext(ex, n_seq_max=2) as ctx:
        for s in (0, 1):
            assert ctx.decode(LlamaBatch(token=PROMPT[:4], seq_id=[[s]] * 4)) == SUCCESS
        assert ctx.memory.seq_rm(0, -1, -1)
        assert ex.driver.kv_allocated(ctx.memory.seq_ids[0]) == 0
        assert ctx.memory.seq_pos_max(1) == 3
        ctx.memory.clear()
        assert [ctx.memory.seq_pos_max(s) for s in (0, 1)] == [-1, -1]
        assert ex.epoch.kv.sequences() == ()
        assert greedy_loop(ctx, PROMPT, 2) == reference(PROMPT, 2)


def test_a_failed_release_leaves_the_sequence_to_start_again():
    faults = FaultPlan.of(FaultRule("kv_release", "code", seq_id=0))
    with make_executor("step", faults=faults) as ex, LlamaContext(ex) as ctx:
        assert ctx.decode(LlamaBatch.get_one(PROMPT)) == SUCCESS
        with pytest.raises(CalfsmError) as info:
            ctx.memory.seq_rm(0, 4, -1)
        assert info.value.stage == "kv_truncate" and info.value.calrt_code == 15
        assert ctx.memory.seq_pos_max(0) == -1 and ctx.memory.is_lost(0)
        with pytest.raises(FailedPrecondition, match="Unknown"):
            ex.epoch.kv.truncate_sequence(ctx.memory.seq_ids[0], 2)
        assert greedy_loop(ctx, PROMPT, 2) == reference(PROMPT, 2)   # cleared first


def test_truncate_is_refused_while_a_job_holds_the_sequence():
    with make_executor("step") as ex, LlamaContext(ex) as ctx:
        assert ctx.decode(LlamaBatch.get_one(PROMPT)) == SUCCESS
        dev = ctx.memory.seq_ids[0]
        handle = ex.enqueue_nowait(Request.decode(dev, 1, len(PROMPT)))
        with pytest.raises(FailedPrecondition, match="open KV reservation"):
            ex.epoch.kv.truncate_sequence(dev, 3)
        drive(ex, handle.done)
        assert ex.epoch.kv.sequence_length(dev) == len(PROMPT) + 1
        ex.epoch.kv.truncate_sequence(dev, 3)
        assert ex.epoch.kv.sequence_length(dev) == 3 == ex.driver.kv_allocated(dev)


def test_context_arguments_are_checked():
    with make_executor("step") as ex:
        for kw in ({"n_seq_max": 0}, {"n_outputs_max": True}, {"n_ubatch": 0},
                   {"logits": np.zeros((1, VOCAB), np.float64)},
                   {"logits": np.zeros((2, VOCAB), np.float32)}):
            with pytest.raises(InvalidArgument):
                LlamaContext(ex, **kw)
        with LlamaContext(ex, n_seq_max=3) as ctx:
            assert len(set(ctx.memory.seq_ids)) == 3


# ---- the example -------------------------------------------------------------------

def test_example_llama_loop_runs_and_prints_the_reference_tokens(capsys):
    spec = importlib.util.spec_from_file_location(
        "llama_loop", ROOT / "examples" / "llama_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--manifest", "tiny", "--tokens", "6"]) == 0
    printed = capsys.readouterr().out.split()
    prompt = list(module.DEFAULT_PROMPT)
    assert [int(t) for t in printed[-6:]] == reference(prompt, 6)
