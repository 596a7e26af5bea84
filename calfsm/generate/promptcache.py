"""The prompt cache: a finished stream's sequence kept warm for the next prompt that
begins the same way.

Theory of operation
-------------------
A chat client sends the whole history with every turn, so without a cache each turn
prefills all of it again. With ``ExecutorConfig(prompt_cache=PromptCacheConfig(...))``,
a one-shot stream (``executor.generate``) that ends with its sequence's KV known and
intact — no job of it in flight, its KV committed (not Unknown, not lost in a reset), in
the generation that is Ready now — hands its sequence and the tokens its KV holds to the
cache (:meth:`PromptCache.keep`) instead of releasing them. Anything else releases the
sequence as before. A sequence the caller opened (``executor.open_sequence()``) is never
handed over: only ``generate``'s own streams have a keeper.

A later ``generate`` takes the entry whose tokens share the longest prefix with its
prompt (:meth:`PromptCache.take`; ties go to the most recently used), leaving at least
one prompt token to prefill (the prefill gives the first token's logits). The entry's KV
is truncated to that prefix (``KvCoordinator.truncate_sequence``: ``kv_release`` of the
tail, exact on every driver) and the stream prefills only the rest at ``past_len =
prefix``. The device's KV of a position depends only on the tokens up to it, so the
rows, and therefore the tokens, greedy or seeded (a stream's sampler draws once per
token whatever its prompt's length), are those of a fresh run.

Budget: at most ``max_sequences`` entries and ``max_tokens`` tokens of KV; storing past
either evicts the least recently used (cause ``budget``). A cached sequence never stands
in the way of work: when no sequence id is free, ``open_sequence``/``generate`` evict
the least recently used entry first (cause ``room``), and when the device refuses KV for
a reservation (``KvCoordinator.on_full``) one entry is evicted on the admission side and
the parked job tries again (cause ``room``), before its admission deadline can pass. A
device reset loses every sequence's KV: when the lifecycle leaves Ready (a drain, a model
switch, a failure) or its generation changes, the cache is emptied (cause ``reset``),
and nothing is stored again until it is Ready. ``close()`` releases everything.

Locking: one lock of its own, a leaf (docs/architecture.md, Lock order): held only
around the entries and the counters. Nothing is called under it: the KV books are read,
a sequence truncated and an evicted one released after it is let go, so it may be taken
under any other lock and takes none.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import numpy as np

from calfsm.engine.kv import SeqState
from calfsm.errors import CalfsmError, InvalidArgument
from calfsm.machines.lifecycle import LifecycleState
from calfsm.machines.sequence import SequenceState
from calfsm.request import Request

__all__ = ["EVICTION_CAUSES", "PromptCache", "PromptCacheConfig", "PromptCacheStats"]

log = logging.getLogger("calfsm.promptcache")

#: why a cached sequence was released: over the budget, room for work (a sequence id or
#: device KV), a reset or recovery that lost its KV
EVICTION_CAUSES = ("budget", "room", "reset")


def _at_least_one(inst: object, attr: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"PromptCacheConfig.{attr.name} must be an integer >= 1, "
                              f"got {value!r}", stage="config")


@attrs.frozen
class PromptCacheConfig:
    """The prompt cache's budget: at most ``max_sequences`` sequences kept warm, holding
    at most ``max_tokens`` tokens of KV in all."""

    max_sequences: int = attrs.field(validator=_at_least_one)
    max_tokens: int = attrs.field(validator=_at_least_one)


@attrs.frozen
class PromptCacheStats:
    """A snapshot of the cache (counters since the executor started)."""

    sequences: int              #: sequences kept warm now
    tokens: int                 #: tokens of KV they hold
    max_sequences: int
    max_tokens: int
    stored: int                 #: sequences handed to the cache
    hits: int                   #: generates that took a cached sequence
    misses: int                 #: generates that found no prefix to reuse
    reused_tokens: int          #: prompt tokens the hits did not prefill
    evictions: dict[str, int]   #: sequences released, by cause (:data:`EVICTION_CAUSES`)


class CachedSequence(Protocol):
    """What the cache uses of a sequence (:class:`calfsm.generate.sequence.Sequence` is one; the
    streams sit above this module, so it is named by what it offers)."""

    seq_id: int
    state: str

    @property
    def position(self) -> int: ...

    def idle(self) -> bool: ...

    def truncate(self, keep_len: int) -> None: ...

    def forget_ended_jobs(self) -> None: ...

    def close_when_done(self) -> None: ...


class CacheHost(Protocol):
    """What the cache reads of its executor: the current generation's KV books and the
    lifecycle (:class:`~calfsm.executor.DeviceExecutor` is one)."""

    @property
    def epoch(self) -> Any: ...

    @property
    def lifecycle(self) -> Any: ...


@attrs.define(slots=True, eq=False)
class _Entry:
    seq: Any                    # a CachedSequence, idle, its KV exactly ``tokens``
    tokens: np.ndarray          # int64, the tokens the KV holds


class PromptCache:
    """Sequences kept warm after their streams ended, least recently used first."""

    def __init__(self, config: PromptCacheConfig, host: CacheHost, *,
                 defer: Callable[[Callable[[], None]], None]) -> None:
        self.config = config
        self._host = host
        #: run a function on the admission side, outside every lock (a release asked for
        #: where device calls are not welcome: a lifecycle listener, the KV books' hook)
        self._defer = defer
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()    # by id, LRU first
        self._tokens = 0
        #: the generation whose KV may be kept (None: not Ready, or closed)
        self._generation: int | None = None
        self._closed = False
        self._room_asked = False            # an eviction for device KV is deferred
        self._stored = self._hits = self._misses = self._reused = 0
        self._evicted = dict.fromkeys(EVICTION_CAUSES, 0)

    # ---- storing -------------------------------------------------------------------
    def keep(self, seq: CachedSequence, tokens: tuple[int, ...]) -> None:
        """A one-shot stream ended (its sequence has no job left): keep ``seq`` warm if
        its KV is known and intact, else release it. ``tokens``: the stream's prompt and
        every token it drew; the KV holds the first ``seq.position`` of them."""
        held = self._intact(seq, tokens)
        if held is not None:
            seq.forget_ended_jobs()     # what it keeps is the KV, not the last results
        evicted: list[_Entry] = []
        with self._lock:
            kept = held is not None and not self._closed \
                and held[1] == self._generation
            if kept:
                arr = held[0]
                self._entries[seq.seq_id] = _Entry(seq, arr)
                self._tokens += len(arr)
                self._stored += 1
                evicted = self._over_budget_locked()
        if not kept:
            seq.close_when_done()
        self._release(evicted)

    def _intact(self, seq: CachedSequence, tokens: tuple[int, ...]
                ) -> tuple[np.ndarray, int] | None:
        """(the tokens the KV holds, its generation) if the sequence's KV is known and
        intact in a Ready generation, else None. Read outside the cache's lock."""
        host = self._host
        life, epoch = host.lifecycle, host.epoch
        if epoch is None or not life.ready or not seq.idle() \
                or seq.state != SequenceState.OPEN:
            return None
        n = seq.position
        kv = epoch.kv
        if not 0 < n <= len(tokens) or kv.sequence_state(seq.seq_id) is not SeqState.READY \
                or kv.sequence_length(seq.seq_id) != n:
            return None
        return np.asarray(tokens[:n], dtype=np.int64), kv.generation

    def _over_budget_locked(self) -> list[_Entry]:
        out = []
        cfg = self.config
        while self._entries and (len(self._entries) > cfg.max_sequences
                                 or self._tokens > cfg.max_tokens):
            out.append(self._pop_locked(next(iter(self._entries)), "budget"))
        return out

    def _pop_locked(self, seq_id: int, cause: str | None) -> _Entry:
        entry = self._entries.pop(seq_id)
        self._tokens -= len(entry.tokens)
        if cause is not None:
            self._evicted[cause] += 1
        return entry

    @staticmethod
    def _release(entries: list[_Entry]) -> None:
        for entry in entries:
            entry.seq.close_when_done()

    # ---- lookup --------------------------------------------------------------------
    @staticmethod
    def key(prompt: Any) -> np.ndarray | None:
        """``prompt`` as the cache compares it, converted as every request's tokens are
        (None when a request would refuse it, or it is empty: the stream refuses it,
        with the reason, and the cache is not asked)."""
        try:
            arr = Request.prefill(0, prompt).tokens
        except InvalidArgument:
            return None
        return arr if len(arr) else None

    def _best_locked(self, prompt: np.ndarray) -> tuple[int, int]:
        """(sequence id, common prefix) of the entry sharing the longest prefix with
        ``prompt``, at most ``len(prompt) - 1``; the most recently used on a tie.
        (-1, 0) when none shares a token."""
        best, best_len = -1, 0
        limit = len(prompt) - 1
        for seq_id, entry in reversed(self._entries.items()):
            m = min(limit, len(entry.tokens))
            if m <= best_len:
                continue
            differ = np.flatnonzero(entry.tokens[:m] != prompt[:m])
            common = int(differ[0]) if len(differ) else m
            if common > best_len:
                best, best_len = seq_id, common
        return best, best_len

    def match(self, prompt: np.ndarray) -> int:
        """Prompt tokens a :meth:`take` would reuse now (0: none); takes nothing."""
        with self._lock:
            return self._best_locked(prompt)[1]

    def take(self, prompt: np.ndarray) -> tuple[Any, int] | None:
        """The cached sequence sharing the longest prefix with ``prompt``, out of the
        cache, its KV truncated to that prefix: ``(sequence, prefix)``; None (a miss)
        when no entry shares a token. An entry whose KV turns out not to be usable (a
        reset got there first) is released and the next best tried."""
        while True:
            with self._lock:
                seq_id, prefix = self._best_locked(prompt)
                if prefix == 0:
                    self._misses += 1
                    return None
                # every entry is of the current generation: a change empties the cache
                entry = self._pop_locked(seq_id, None)
            try:
                entry.seq.truncate(prefix)
            except CalfsmError as e:
                log.warning("a cached sequence %s could not be reused: %s", seq_id,
                            str(e), extra=e.context())
                with self._lock:
                    self._evicted["reset"] += 1
            else:
                with self._lock:
                    self._hits += 1
                    self._reused += prefix
                return entry.seq, prefix
            entry.seq.close_when_done()

    # ---- making room ---------------------------------------------------------------
    def evict_one(self) -> bool:
        """Release the least recently used entry now (in the caller's thread); False if
        the cache is empty."""
        with self._lock:
            if not self._entries:
                return False
            entry = self._pop_locked(next(iter(self._entries)), "room")
        entry.seq.close_when_done()
        return True

    def need_room(self) -> None:
        """The device refused KV for a reservation: evict the least recently used entry on
        the admission side (its release calls the KV books' ``on_freed``, and the parked
        job tries again). One eviction is pending at a time; a refusal after it asks for
        the next. Safe from any thread holding any lock but this one."""
        with self._lock:
            if not self._entries or self._room_asked or self._closed:
                return
            self._room_asked = True
        self._defer(self._make_room)

    def _make_room(self) -> None:
        with self._lock:
            self._room_asked = False
        self.evict_one()

    # ---- resets and close ----------------------------------------------------------
    def lifecycle_changed(self) -> None:
        """A lifecycle listener: out of Ready, or in a new generation, the device's KV is
        not what the entries say (a reset loses it): empty the cache (cause ``reset``;
        the sequences are released on the admission side) and keep nothing until Ready."""
        life = self._host.lifecycle
        ready = life.state == LifecycleState.READY
        generation = life.generation if ready else None
        with self._lock:
            if self._closed or generation == self._generation:
                return
            self._generation = generation
            lost = list(self._entries.values())
            self._entries.clear()
            self._tokens = 0
            self._evicted["reset"] += len(lost)
        for entry in lost:
            self._defer(entry.seq.close_when_done)

    def close(self) -> None:
        """Release every entry now and keep nothing more (the executor is closing)."""
        with self._lock:
            self._closed = True
            self._generation = None
            entries = list(self._entries.values())
            self._entries.clear()
            self._tokens = 0
        self._release(entries)

    # ---- observation ---------------------------------------------------------------
    def stats(self) -> PromptCacheStats:
        with self._lock:
            return PromptCacheStats(
                sequences=len(self._entries), tokens=self._tokens,
                max_sequences=self.config.max_sequences,
                max_tokens=self.config.max_tokens, stored=self._stored,
                hits=self._hits, misses=self._misses, reused_tokens=self._reused,
                evictions=dict(self._evicted))
