"""Embedding prefill end to end: the lease writes the rows bit for bit, and the executor
runs Request.prefill_embeds in the manifest's dtype, then decodes on the same chain."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from calfsm.drivers.base import Calbin
from calfsm.drivers.sim import SimDriver
from calfsm.engine.buffers import BufferPool
from calfsm.errors import InvalidArgument, check
from calfsm.manifest import DType, TaskKind
from calfsm.request import EMBED_DTYPES, Request
from calfsm.runtime.sync import THREADS
from tests.helpers import refmodel_pure as pure
from tests.helpers.embeds import EMBEDS_GOLDEN_TOKENS, golden_embeds, tiny_with_embeds_dtype
from tests.helpers.executor import TINY, calls, finish, make_executor

SEQ = 5



def _lease(dtype: DType):
    m = tiny_with_embeds_dtype(dtype)
    driver = SimDriver(m)
    check(driver.configure(Calbin.from_manifest(m)), "configure")
    sub = m.submodel(TaskKind.PREFILL_EMBEDS)
    code, handle = driver.model(sub.exact_name)
    check(code, "model")
    pool = BufferPool.build(driver, 0, {sub.kind: (handle, sub)}, sync=THREADS)
    return pool.acquire(sub.kind)


@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16])
def test_lease_writes_embedding_rows_bit_for_bit(dtype) -> None:
    lease = _lease(dtype)
    embeds = golden_embeds(3, dtype=EMBED_DTYPES[dtype])
    assert lease.load(SEQ, embeds, [0, 1, 2]) == 3
    host = lease.slot.token_host.reshape(-1).view(np.uint8)
    assert host[:embeds.nbytes].tobytes() == embeds.tobytes()
    assert not host[embeds.nbytes:].any()
    assert lease.slices[lease.slot.contract.token_or_embed.name] == (0, embeds.nbytes)


@pytest.mark.parametrize(("dtype", "given"), [
    (DType.F32, np.float64),            # was cast silently into the float32 tensor
    (DType.F32, np.float16),
    (DType.BF16, np.float32),
    (DType.F16, ml_dtypes.bfloat16),
])
def test_lease_refuses_embeddings_of_another_dtype(dtype, given) -> None:
    lease = _lease(dtype)
    with pytest.raises(InvalidArgument, match=f"takes {dtype.value}") as info:
        lease.load(SEQ, golden_embeds(2, dtype=given), [0, 1])
    assert info.value.stage == "prepare" and info.value.seq_id is None
    assert not lease.slot.token_host.any()              # nothing written


def test_prefill_embeds_then_decode_through_the_executor(mode) -> None:
    embeds = golden_embeds()
    words = [pure.embed_word(row.tobytes()) for row in embeds]
    with make_executor(mode) as ex:
        r = finish(ex, ex.enqueue(Request.prefill_embeds(SEQ, embeds)))
        assert r.kind is TaskKind.PREFILL_EMBEDS and r.token_count == len(embeds)
        want = pure.logits_bf16(pure.hashes(words)[-1], 1024)
        assert (r.logits.view(np.uint32) >> 16).tolist() == want
        tokens, pos = [r.greedy()], len(embeds)
        while len(tokens) < len(EMBEDS_GOLDEN_TOKENS):
            r = finish(ex, ex.enqueue(Request.decode(SEQ, tokens[-1], pos)))
            tokens.append(r.greedy())
            pos += 1
        assert tokens == EMBEDS_GOLDEN_TOKENS
        assert ex.stats().inflight == 0 and ex.epoch.pool.stats().leased == 0


@pytest.mark.parametrize(("embeds", "match"), [
    (golden_embeds(2, dtype=np.float32), "takes BF16"),
    (golden_embeds(2, hidden=32), "hidden size"),
    (golden_embeds(TINY.submodel(TaskKind.PREFILL_EMBEDS).max_tokens + 1), "exceed tensor"),
])
def test_bad_embeddings_fail_before_the_device(mode, embeds, match) -> None:
    embeds = np.abs(embeds)     # no negative values: the token-id range check must not fire
    with make_executor(mode) as ex:
        infers = len(calls(ex.driver, "infer"))
        h = ex.enqueue(Request.prefill_embeds(SEQ, embeds))
        err = finish(ex, h)
        assert isinstance(err, InvalidArgument), err
        assert match in str(err)
        assert err.job_id == h.job_id and err.seq_id == SEQ
        assert len(calls(ex.driver, "infer")) == infers
        assert ex.epoch.pool.stats().leased == 0 and ex.epoch.kv.stats().open == 0

