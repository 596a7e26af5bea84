"""Acceptance, spec section 13.1 (correctness), through the executor.

- The 100 golden prompts give the same 16 greedy tokens through the executor as through
  the direct synchronous path (:class:`calfsm.tools.direct.DirectRunner`): all 100 in
  threaded mode from several caller threads at once, 20 in step mode under seeded
  interleavings.
- Prompt lengths 1, 2, 15, 16, 17, 127, 128, 1024, 4095, 4096 and 40959 work on
  ``qwen3-b1`` (V=151936, max_seq 40960): the prefill logits equal the reference model
  bit for bit, and the decodes that fit give the reference tokens. 40960 plus a decode is
  rejected with InvalidArgument before anything reaches the device.
- Two sequences alternating for 1000 tokens each show no cross-talk.
- ``calfsm run`` works, and under swarm fault plans exits 0 or 3 (3 only when the
  executor ended Failed), never hangs, never raises.

Expected tokens come from the direct path or from the hash chain of the independent
pure-Python model (:mod:`tests.helpers.refmodel_pure`) with the vectorised logits of
:mod:`calfsm.drivers.refmodel` (which ``tests/api/test_golden.py`` checks against the pure logits).
"""

from __future__ import annotations

import contextlib
import io
import re
import threading

import numpy as np
import pytest

from calfsm.drivers import refmodel
from calfsm.engine.job import InferenceResult, JobHandle, Request
from calfsm.errors import InvalidArgument
from calfsm.executor import DeviceExecutor
from calfsm.manifest import TaskKind, builtin_manifest
from calfsm.runtime.stepper import StepScheduler
from calfsm.tools import cli
from calfsm.tools.direct import golden_prompts
from tests.helpers import refmodel_pure as pure
from tests.helpers.executor import MODES, TINY, calls, make_executor, make_sim, two_in_flight
from tests.helpers.streams import golden_tokens

N_TOKENS = 16
QWEN = builtin_manifest("qwen3-b1")
QWEN_V = QWEN.submodel(TaskKind.DECODE).vocab
QWEN_MAX_SEQ = QWEN.submodel(TaskKind.DECODE).max_seq
LENGTHS = (1, 2, 15, 16, 17, 127, 128, 1024, 4095, 4096, 40959)


@pytest.fixture(scope="module")
def golden_direct() -> list[list[int]]:
    """The golden's tokens through the direct path (tiny manifest, as test_golden)."""
    return golden_tokens(golden_prompts(), N_TOKENS, seq_per_prompt=True)


def _assert_clean(ex: DeviceExecutor, failed: int = 0) -> None:
    """Nothing leaked, nothing failed but the ``failed`` rejections expected."""
    st = ex.stats()
    assert st.leased == 0 and st.inflight == 0 and st.queued == 0, st
    assert st.failed == failed and st.cancelled == st.quarantined == 0, st
    assert ex.epoch.kv.stats().open == 0
    assert ex.lifecycle_state == "Ready"


def _bf16(r: InferenceResult) -> np.ndarray:
    """The result's float32 logits back as BF16 bits (exact: they were BF16)."""
    bits = r.logits.view(np.uint32)
    assert not np.any(bits & 0xFFFF), "float32 logits carry bits below BF16"
    return (bits >> 16).astype(np.uint16)


# ---- the golden: executor == direct path ----------------------------------------------

def _generate_threaded(ex: DeviceExecutor, seq: int, prompt: list[int], n: int) -> list[int]:
    r = ex.enqueue(Request.prefill(seq, prompt)).result(30)
    out, pos = [r.greedy()], len(prompt)
    while len(out) < n:
        r = ex.enqueue(Request.decode(seq, out[-1], pos)).result(30)
        out.append(r.greedy())
        pos += 1
    ex.reset_sequence(seq)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inflight", [1, 2])
def test_golden_100_prompts_threaded_from_four_callers(golden_direct, inflight, tmp_path):
    prompts = golden_prompts()
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    callers = 4
    drv = make_sim("threaded")
    config = two_in_flight(tmp_path, drv) if inflight == 2 else {}

    with make_executor("threaded", driver=drv, **config) as ex:
        assert ex.health().max_inflight == inflight
        def caller(k: int) -> None:
            try:
                for i in range(k, len(prompts), callers):
                    got[i] = _generate_threaded(ex, k, prompts[i], N_TOKENS)
            except BaseException as e:            # surfaced below, not lost in a thread
                errors.append(e)

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(100)
        assert not errors, errors
        assert not [t for t in threads if t.is_alive()]
        for i, want in enumerate(golden_direct):
            assert got[i] == want, f"prompt {i} (len {len(prompts[i])})"
        assert ex.stats().succeeded == len(prompts) * N_TOKENS
        _assert_clean(ex)
    assert ex.stats().leased == 0


def _generate_step(ex: DeviceExecutor, sched: StepScheduler, prompts: list[list[int]],
                   n: int, lanes: int) -> dict[int, list[int]]:
    """Run ``prompts`` on ``lanes`` sequences at once: each lane keeps one job in the
    executor, the scheduler picks the interleaving."""
    todo = list(enumerate(prompts))
    lane: dict[int, tuple[int, list[int], JobHandle]] = {}   # seq -> (prompt, tokens, job)
    out: dict[int, list[int]] = {}

    def start(seq: int) -> None:
        if todo:
            i, prompt = todo.pop(0)
            lane[seq] = (i, [], ex.enqueue(Request.prefill(seq, prompt)))

    for seq in range(lanes):
        start(seq)
    while lane:
        sched.run_until(lambda: any(h.done() for _, _, h in lane.values()))
        for seq, (i, toks, h) in list(lane.items()):
            if not h.done():
                continue
            toks.append(h.result().greedy())
            if len(toks) == n:
                out[i] = toks
                del lane[seq]
                ex.reset_sequence(seq)
                start(seq)
            else:
                pos = len(prompts[i]) + len(toks) - 1
                lane[seq] = (i, toks, ex.enqueue(Request.decode(seq, toks[-1], pos)))
    return out


@pytest.mark.parametrize("seed,inflight", [(0, 1), (1, 1), (2, 2)])
def test_golden_20_prompts_step_mode_seeded_interleavings(golden_direct, seed, inflight,
                                                          tmp_path):
    prompts = golden_prompts()[:20]             # the edge lengths 1..4096 and ten more
    drv = make_sim("step")
    config = two_in_flight(tmp_path, drv) if inflight == 2 else {}
    with make_executor("step", driver=drv, **config) as ex:
        assert ex.health().max_inflight == inflight
        sched = StepScheduler(ex, seed=seed)
        got = _generate_step(ex, sched, prompts, N_TOKENS, lanes=3)
        for i in range(len(prompts)):
            assert got[i] == golden_direct[i], f"prompt {i} (len {len(prompts[i])})"
        # one in flight: 2 slots for 3 lanes, so jobs park for admission; two in flight
        # has a slot per lane on each engine
        assert {"submit", "complete"} | ({"admit"} if inflight == 1 else set()) \
            <= set(sched.log)
        _assert_clean(ex)


# ---- prompt lengths up to max_seq - 1 on qwen3-b1 --------------------------------------

@pytest.fixture(scope="module", params=MODES)
def qwen_ex(request):
    ex = make_executor(request.param, manifest=QWEN)
    yield ex
    ex.close()


def _run(ex: DeviceExecutor, req: Request) -> JobHandle:
    h = ex.enqueue(req)
    if not ex.config.threaded:
        StepScheduler(ex).run_until(h.done)
    h.exception(60)
    return h


def _prompt(n: int) -> list[int]:
    rng = np.random.default_rng(n)
    return rng.integers(0, QWEN_V, n).tolist()


@pytest.mark.parametrize("n", LENGTHS)
def test_prompt_length_prefill_exact_then_decodes(qwen_ex, n):
    ex, seq = qwen_ex, n % 997
    failed = ex.stats().failed               # the module's executor is shared
    prompt = _prompt(n)
    kv: dict[int, int] = {}
    h = pure.hashes(prompt, 0, kv)[-1]
    r = _run(ex, Request.prefill(seq, prompt)).result()
    assert r.token_count == n and r.logits.shape == (QWEN_V,)
    np.testing.assert_array_equal(_bf16(r), refmodel.logits_bf16(h, QWEN_V))
    tok, pos = r.greedy(), n
    for _ in range(min(3, QWEN_MAX_SEQ - n)):        # 40959 leaves room for one decode
        h = pure.hashes([tok], pos, kv)[0]
        r = _run(ex, Request.decode(seq, tok, pos)).result()
        want = refmodel.logits_bf16(h, QWEN_V)
        np.testing.assert_array_equal(_bf16(r), want)
        assert r.greedy() == refmodel.greedy(want)
        tok, pos = r.greedy(), pos + 1
    assert ex.epoch.kv.sequence_length(seq) == pos
    ex.reset_sequence(seq)
    _assert_clean(ex, failed=failed)


def test_40960_plus_a_decode_is_rejected_by_the_bounds_check(qwen_ex):
    ex, seq = qwen_ex, 40
    failed = ex.stats().failed
    r = _run(ex, Request.prefill(seq, _prompt(QWEN_MAX_SEQ))).result()   # exactly full
    assert r.token_count == QWEN_MAX_SEQ
    infers = len(calls(ex.driver, "infer"))
    for req in (Request.decode(seq, r.greedy(), QWEN_MAX_SEQ),           # the 40961st
                Request.decode(seq + 1, 1, QWEN_MAX_SEQ),                 # past_len 40960
                Request.prefill(seq + 2, [1] * (QWEN_MAX_SEQ + 1))):      # 40961 at once
        h = _run(ex, req)
        err = h.exception()
        assert isinstance(err, InvalidArgument), err
        assert err.stage == "validate" and err.job_id == h.job_id
        assert err.http_status == 400
    assert len(calls(ex.driver, "infer")) == infers       # nothing reached the device
    assert ex.epoch.kv.sequence_length(seq) == QWEN_MAX_SEQ   # the sequence is intact
    ex.reset_sequence(seq)
    _assert_clean(ex, failed=failed + 3)


# ---- no cross-talk ----------------------------------------------------------------------

ALT_TOKENS = 1000


def _alone(prompt: list[int], n: int, vocab: int) -> list[int]:
    """``n`` greedy tokens of one sequence run alone through the reference model."""
    kv: dict[int, int] = {}
    h = pure.hashes(prompt, 0, kv)[-1]
    out = []
    for i in range(n):
        out.append(refmodel.greedy(refmodel.logits_bf16(h, vocab)))
        h = pure.hashes([out[-1]], len(prompt) + i, kv)[0]
    return out


@pytest.mark.parametrize("mode,seed", [("threaded", 0), ("step", 0), ("step", 1)])
@pytest.mark.timeout(120)
def test_two_sequences_alternating_1000_tokens_no_cross_talk(mode, seed):
    vocab = TINY.submodel(TaskKind.DECODE).vocab
    # the same prompt but its last token: a swapped or shared KV word shows at once
    prompts = {3: [11, 22, 33, 44, 55], 4: [11, 22, 33, 44, 56]}
    want = {s: _alone(p, ALT_TOKENS, vocab) for s, p in prompts.items()}
    assert want[3] != want[4]
    got: dict[int, list[int]] = {s: [] for s in prompts}
    with make_executor(mode) as ex:
        sched = None if mode == "threaded" else StepScheduler(ex, seed=seed)
        pending = {s: ex.enqueue(Request.prefill(s, p)) for s, p in prompts.items()}
        while pending:
            if sched is not None:
                sched.run_until(lambda p=pending: all(h.done() for h in p.values()))
            nxt = {}
            for s, h in pending.items():             # both in the executor at once
                got[s].append(h.result(30).greedy())
                if len(got[s]) < ALT_TOKENS:
                    pos = len(prompts[s]) + len(got[s]) - 1
                    nxt[s] = ex.enqueue(Request.decode(s, got[s][-1], pos))
            pending = nxt
        for s in prompts:
            assert got[s] == want[s], f"sequence {s} diverged at token " \
                f"{next(i for i, (a, b) in enumerate(zip(got[s], want[s])) if a != b)}"
            assert ex.epoch.kv.sequence_length(s) == len(prompts[s]) + ALT_TOKENS - 1
        _assert_clean(ex)


# ---- calfsm run -----------------------------------------------------------------------

def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(list(argv))
    return rc, out.getvalue()


def _row(text: str, metric: str) -> str:
    m = re.search(rf"{re.escape(metric)}\s*│\s*(.*?)\s*│", text)
    assert m, f"no row {metric!r} in:\n{text}"
    return m.group(1)


@pytest.mark.timeout(60)
def test_calfsm_run_workload():
    rc, text = _cli("run", "--prompts", "4", "--sequences", "2", "--tokens", "4",
                    "--manifest", "tiny", "--quiet")
    assert rc == cli.EXIT_OK, text
    assert _row(text, "leased buffers at exit") == "0"
    assert _row(text, "tokens generated") == "16"
    assert _row(text, "errors by category") == "none"
    assert _row(text, "lifecycle at end of workload") == "Ready"


@pytest.mark.timeout(60)
def test_calfsm_run_exits_3_when_shutdown_cannot_drain(monkeypatch):
    """A job the device never gave back (a hang outliving the drain bound) is not a clean
    exit: the table is printed, then the shutdown error, and the status is 3."""
    from calfsm.errors import Unavailable
    from calfsm.executor import DeviceExecutor

    real_close = DeviceExecutor.close

    def close(self, timeout=None):
        real_close(self, timeout)
        raise Unavailable("shutdown did not drain within 10.0 s: 1 job(s) still on the "
                          "device, threads alive: []", stage="shutdown")

    monkeypatch.setattr(DeviceExecutor, "close", close)
    rc, text = _cli("run", "--prompts", "2", "--sequences", "1", "--tokens", "2",
                    "--manifest", "tiny", "--quiet")
    assert rc == cli.EXIT_DEVICE_FAILED, text
    assert "shutdown did not drain" in text
    assert _row(text, "lifecycle at end of workload") == "Ready"


# Seeds whose plans carry no KV refusal: a refused kv_apply with nothing else open
# waits out the 10 s admission deadline (FI04 behaviour), which is correct but slow.
@pytest.mark.parametrize("seed", [0, 11])
@pytest.mark.timeout(60)
def test_calfsm_run_under_swarm_faults_exits_0_or_3(seed):
    from calfsm.drivers.faults import FaultPlan
    assert "kv_" not in FaultPlan.swarm(seed).describe()
    rc, text = _cli("run", "--prompts", "8", "--sequences", "2", "--tokens", "8",
                    "--manifest", "tiny", "--quiet", "--faults", "swarm",
                    "--seed", str(seed))
    assert rc in (cli.EXIT_OK, cli.EXIT_DEVICE_FAILED), text
    if "start-up failed" in text:
        assert rc == cli.EXIT_DEVICE_FAILED
        return
    state = _row(text, "lifecycle at end of workload")
    wedged = state == "Failed" or "shutdown:" in text
    assert (rc == cli.EXIT_DEVICE_FAILED) == wedged, text
    if rc == cli.EXIT_OK:
        assert _row(text, "leased buffers at exit") == "0"
