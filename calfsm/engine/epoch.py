"""An *epoch* is the resources of one model generation, and its golden check.

One name for one thing: the *generation* is the number (``Lifecycle.generation``,
``JobContext.generation``, ``Epoch.generation``), counted up by every configure; the
:class:`Epoch` is what was built for that number. Nothing else is called an epoch.

Configuring a model creates, together and only together: the resolved sub-model handles,
the KV coordinator and the buffer pool, all stamped with one generation number. Recovery
and model switches never patch these in place; they build a new :class:`Epoch` and retire
the old one. A job keeps a reference to the epoch it was admitted in, so a completion that
arrives after a reset can only ever reach its own (retired) epoch's KV and pool — the
generation fence is structural, not a check someone may forget.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from calfsm.drivers import refmodel
from calfsm.drivers.base import SEQ_LIMIT, Calbin, Driver, EngineSlot, JobTag
from calfsm.engine.buffers import BufferPool
from calfsm.engine.kv import KvCoordinator
from calfsm.engine.readback import check_output, read_output
from calfsm.engine.shapes import ShapeBuckets
from calfsm.engine.stepcost import ServiceModel, WarmupTiming
from calfsm.engine.sync import Sync
from calfsm.errors import (
    CalfsmError,
    Incompatible,
    Internal,
    ManifestError,
    check,
    from_calrt,
)
from calfsm.manifest import GraphKey, Manifest, ModelGeneration, SubmodelContract, TaskKind

__all__ = ["WARMUP_PROMPT", "WARMUP_SEQ", "Epoch", "build_epoch", "warm_up"]

log = logging.getLogger("calfsm.epoch")

#: The sequence id the warm-up golden uses; requests may not use it.
WARMUP_SEQ = SEQ_LIMIT - 1
#: The fixed prompt of the warm-up golden and how many tokens it decodes.
WARMUP_PROMPT = (1, 2, 3)
WARMUP_DECODE = 2


@attrs.define(eq=False)
class Epoch:
    """The resources of one generation (its number: :attr:`generation`): the model
    handles, the KV coordinator and the buffer pool, built and retired together."""

    generation: int
    manifest: Manifest
    calbin: Calbin
    model: ModelGeneration
    handles: Mapping[TaskKind, Any]
    kv: KvCoordinator
    pool: BufferPool
    retired: bool = False
    #: every graph's handle by its key: shape buckets beside each kind's widest graph
    #: (``handles``); the device lists and resolves them all (spec 10.2)
    graph_handles: Mapping[GraphKey, Any] = attrs.field(factory=dict)
    #: the decode graphs a step may be moved to (None: one graph, the widest), and the
    #: ones taken out because their warm-up golden failed (exact name -> why)
    buckets: ShapeBuckets | None = None
    graph_failures: dict[str, str] = attrs.field(factory=dict)
    #: the contracts asked for so far (every job's validation asks: one call, not two)
    _contracts: dict[TaskKind, SubmodelContract] = attrs.field(factory=dict, init=False,
                                                               repr=False)

    def usable_buckets(self) -> tuple[str, ...]:
        """The shape buckets steps may run on now (their golden passed)."""
        if self.buckets is None:
            return ()
        return tuple(n for n in self.buckets.names if n not in self.graph_failures)

    def contract(self, kind: TaskKind) -> SubmodelContract:
        c = self._contracts.get(kind)
        if c is None:
            c = self._contracts[kind] = self.model.submodel(kind)
        return c

    def retire(self) -> None:
        """Fence this epoch off: its coordinator refuses work, its slots are retired."""
        if self.retired:
            return
        self.retired = True
        self.kv.fence()
        self.pool.retire()


def check_batch_calls(manifest: Manifest, driver: Driver) -> None:
    """Refuse a calbin with batch graphs on a driver without the batch calls
    (``Capabilities.batch_rows``): it could not say which row a job's inputs are, so
    not even one row per job would run (category compatibility: no reset helps)."""
    batched = [s for s in manifest.submodels if s.batched]
    if batched and not driver.capabilities().batch_rows:
        names = ", ".join(s.kind.value for s in batched)
        raise Incompatible(f"{names}: batch graphs (max_batch "
                           f"{max(s.max_batch for s in batched)}) need a driver with the "
                           f"batch calls; driver {driver.name!r} "
                           "has none (Capabilities.batch_rows; docs/driver-protocol.md, "
                           "Batches)", stage="manifest")

def build_epoch(driver: Driver, manifest: Manifest, calbin: Calbin, generation: int, *,
                max_inflight: int, slots_per_engine: int, token_budget: int | None,
                sync: Sync, engines: tuple[EngineSlot, ...] = (EngineSlot.AUTO,),
                configure: bool = True, batch_rows: int = 1,
                buckets: ShapeBuckets | None = None) -> Epoch:
    """Resolve, configure and build an epoch. Raises a classified :class:`CalfsmError`.

    The manifest is resolved against the calbin's model list *before* the device is
    configured (FI01: a manifest typo fails start-up with nothing configured), and again
    against what the configured device lists; a manifest for another CalRT version than
    the driver runs is refused before configuring too (``Incompatible``).
    ``configure=False`` reuses a configuration the device kept (after a CCU-only reset).
    With ``batch_rows`` > 1 (continuous batching) the decode graph gets that many times
    the slots plus one batch more: every row of the step on the device, the rows queued
    for the next step and their steps staged ahead each hold a slot of their own.
    ``buckets``: the shape buckets steps may move to. Jobs are then prepared in slots of
    the narrowest decode graph (a row's tokens and positions, copied into the graph its
    step runs on at submit: docs/driver-protocol.md, Shape buckets) and every graph gets
    ``slots_per_engine + 1`` slots per engine of its own for the steps on the device.
    """
    manifest.resolve(calbin.models)
    manifest.check_runtime(driver.version())   # before the device hears of it, like FI01
    check_batch_calls(manifest, driver)
    if configure:
        check(driver.configure(calbin), "configure", generation=generation)
    code, listed = driver.get_all_models()
    check(code, "get_all_models", generation=generation)
    device_models = manifest.resolve(listed or ())
    handles: dict[TaskKind, Any] = {}
    graph_handles: dict[GraphKey, Any] = {}
    for sub in manifest.submodels:
        code, handle = driver.model(sub.exact_name)
        check(code, "model_lookup", generation=generation)
        graph_handles[sub.key] = handle
        if sub is manifest.submodel(sub.kind):   # the widest graph takes every step
            handles[sub.kind] = handle
    model = manifest.generation(generation, device_models)
    max_seq = max(s.max_seq for s in manifest.submodels)
    rows = max(1, batch_rows)
    kv = KvCoordinator(driver, max_seq=max_seq,
                       token_budget=token_budget or max_seq * max(4, 2 * max_inflight, rows),
                       generation=generation, sync=sync)
    kinds = {kind: (handles[kind], model.submodel(kind)) for kind in handles}
    on_device = None
    if buckets is not None:     # prepared in the narrowest, run on the one chosen
        narrowest = buckets.graphs[0]
        kinds[TaskKind.DECODE] = (graph_handles[narrowest.key], narrowest)
        on_device = {g.exact_name: (graph_handles[g.key], g) for g in buckets.graphs}
    pool = BufferPool.build(
        driver, generation, kinds,
        sync=sync, engines=engines, slots_per_engine=slots_per_engine,
        extra={TaskKind.DECODE: (slots_per_engine + 1) * rows - slots_per_engine}
        if rows > 1 else None, buckets=on_device, bucket_slots=slots_per_engine + 1)
    return Epoch(generation, manifest, calbin, model, handles, kv, pool,
                 graph_handles=graph_handles, buckets=buckets)


def expected_warmup_tokens(vocab: int) -> list[int]:
    """The greedy tokens the reference model gives for the warm-up prompt."""
    kv = np.zeros(len(WARMUP_PROMPT) + WARMUP_DECODE + 1, dtype=np.uint32)
    h = refmodel.H_INIT
    for pos, tok in enumerate(WARMUP_PROMPT):
        h = refmodel.step(h, tok, pos)
        kv[pos] = h
    out = []
    pos = len(WARMUP_PROMPT)
    for _ in range(WARMUP_DECODE):
        tok = refmodel.greedy(refmodel.logits_bf16(h, vocab))
        out.append(tok)
        h = refmodel.step(h, tok, pos)
        pos += 1
    return out


def warm_up(driver: Driver, epoch: Epoch, service: ServiceModel) -> WarmupTiming:
    """Run the fixed golden prefill + decode on the new generation and compare it with
    the reference model. Any code, status or token difference raises; the sequence is
    released afterwards either way. Returns how long each step took (the service model
    calibrates its expectation with it); each waits at most its execution timeout."""
    prefill = epoch.contract(TaskKind.PREFILL_IDS) if TaskKind.PREFILL_IDS in epoch.handles \
        else None
    decode = epoch.contract(TaskKind.DECODE) if TaskKind.DECODE in epoch.handles else None
    if prefill is None or decode is None:
        raise ManifestError("warm-up needs a prefill_ids and a decode sub-model",
                            generation=epoch.generation, stage="warmup")
    widest = epoch.manifest.submodel(TaskKind.DECODE).exact_name
    took = _golden(driver, epoch, service, decode.vocab,
                   widest if epoch.buckets is not None else None)
    for name in epoch.buckets.names if epoch.buckets is not None else ():
        if name == widest:
            continue                    # the golden above ran on it
        try:            # every graph runs its golden before Ready; one failing is
            _golden(driver, epoch, service, decode.vocab, name)     # taken out alone
        except CalfsmError as e:
            epoch.graph_failures[name] = why = f"warm-up golden failed: {e.message}"
            log.warning("shape bucket %s taken out: %s", name, why,
                        extra={"generation": epoch.generation, "stage": "warmup"})
    return WarmupTiming(len(WARMUP_PROMPT), took[0], tuple(took[1:]))


def _golden(driver: Driver, epoch: Epoch, service: ServiceModel, vocab: int,
            graph: str | None) -> list[float]:
    """The golden prefill + decode, the decode on the shape bucket ``graph`` (None: the
    widest); raises on any difference, the warm-up sequence released either way."""
    want = expected_warmup_tokens(vocab)
    got: list[int] = []
    took: list[float] = []
    logits = np.empty(vocab, dtype=np.float32)
    clock = driver.clock
    try:
        tokens = list(WARMUP_PROMPT)
        kind, past, on = TaskKind.PREFILL_IDS, 0, None
        for step in range(WARMUP_DECODE):
            t0 = clock.now()
            _run_direct(driver, epoch, kind, WARMUP_SEQ, tokens, past, logits,
                        service.execution_timeout_s(kind, len(tokens)), graph=on)
            took.append(clock.now() - t0)
            tok = int(np.argmax(logits))
            got.append(tok)
            past += len(tokens)
            tokens = [tok]
            kind, on = TaskKind.DECODE, graph
            del step
        if got != want:
            raise Internal(f"warm-up golden mismatch{f' on {graph}' if graph else ''}: "
                           f"got {got}, reference {want}",
                           generation=epoch.generation, stage="warmup")
    except CalfsmError as e:
        e.with_context(generation=epoch.generation, stage="warmup")
        _release_warmup(driver, epoch, quiet=True)
        raise
    except BaseException:
        _release_warmup(driver, epoch, quiet=True)
        raise
    _release_warmup(driver, epoch, quiet=False)
    return took


def _release_warmup(driver: Driver, epoch: Epoch, *, quiet: bool) -> None:
    """Release the warm-up sequence; every code is checked. ``quiet``: another error is
    already on its way out, so a failed release is logged instead of hiding it."""
    code = driver.kv_release(WARMUP_SEQ, 0)
    if code == 0:
        return
    err = from_calrt(code, "warmup_kv_release", seq_id=WARMUP_SEQ,
                     generation=epoch.generation)
    if not quiet:
        raise err
    log.warning("releasing the warm-up sequence failed: %s", err, extra=err.context())


def _run_direct(driver: Driver, epoch: Epoch, kind: TaskKind, seq: int, tokens: list[int],
                past: int, dst: np.ndarray, timeout_s: float, *,
                graph: str | None = None) -> None:
    n = len(tokens)
    ctx = {"seq_id": seq, "generation": epoch.generation}
    if not driver.kv_apply(seq, past + n):
        raise from_calrt(1, "warmup_kv", message="warm-up could not allocate KV", **ctx)
    lease = epoch.pool.acquire(kind, graph=graph)
    contract = lease.slot.contract
    clean = False
    try:
        lease.bind(seq_id=seq)
        lease.load(seq, tokens, range(past, past + n))
        slot = lease.slot
        check(driver.infer(slot.model, slot.inp, slot.out,
                           tag=JobTag(0, seq, epoch.generation)), "warmup_infer", **ctx)
        lease.mark_on_device()
        check(driver.wait(slot.out, timeout_s), "warmup_wait", **ctx)
        lease.mark_off_device()
        check_output(read_output(driver, slot.out, contract), slot.logits_bf16, contract, n,
                     dst, ctx)
        lease.undo_slices()
        clean = True
    finally:
        if clean:
            epoch.pool.release(lease)
        else:
            epoch.pool.quarantine(lease, "warm-up failed")
