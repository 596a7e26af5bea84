"""Threads queued in a blocking admission call in a known order, without sleeping."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from calfsm.errors import CalfsmError, Cancelled


def queue_in_order(n: int, call: Callable[[int, Callable[[], bool]], Any], *,
                   then: Callable[[Any], object] | None = None,
                   cancel_flags: list[threading.Event] | None = None
                   ) -> tuple[list[threading.Thread], list[tuple[int, Any]]]:
    """Start ``n`` threads running ``call(i, cancelled)``, one after the other: each is
    asleep in the queue before the next starts (its ``cancelled`` hook ran, which the
    coordinator and the pool call under their lock right before they wait), so the
    queue order is ``i``. ``cancelled`` answers ``cancel_flags[i]``. ``then(result)``
    runs in the thread once it is served. Returns the threads and the outcomes in the
    order they came: ``(i, result or CalfsmError)``."""
    outcomes: list[tuple[int, Any]] = []
    threads = []
    for i in range(n):
        waiting = threading.Event()
        flag = cancel_flags[i] if cancel_flags else None

        def cancelled(waiting: threading.Event = waiting,
                      flag: threading.Event | None = flag) -> bool:
            waiting.set()
            return bool(flag and flag.is_set())

        def run(i: int = i, cancelled: Callable[[], bool] = cancelled) -> None:
            try:
                result = call(i, cancelled)
            except CalfsmError as e:
                outcomes.append((i, e))
                return
            outcomes.append((i, result))
            if then is not None:
                then(result)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        assert waiting.wait(10), f"waiter {i} never queued"
        threads.append(t)
    return threads, outcomes


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a waiter was stranded"


def served_after_a_cancelled_head(
        queue: Callable[..., tuple[list[threading.Thread], list[tuple[int, Any]]]],
        free: Callable[[], object]) -> Any:
    """Two waiters queued by ``queue(2, cancel_flags=...)`` behind held capacity; the
    head is cancelled (it sees it only at its next wake-up) and ``free()`` gives the
    capacity back, which wakes the head alone: it must leave and pass the head role on,
    with no ``wake_all`` from anyone. Returns what the second waiter got."""
    flags = [threading.Event(), threading.Event()]
    threads, outcomes = queue(2, cancel_flags=flags)
    flags[0].set()
    free()
    join_all(threads)
    assert [i for i, _ in outcomes] == [0, 1]
    assert isinstance(outcomes[0][1], Cancelled)
    return outcomes[1][1]


def check_wake_all_and_stop_reach_everyone(
        queue: Callable[..., tuple[list[threading.Thread], list[tuple[int, Any]]]],
        wake_all: Callable[[], None], stop: Callable[[], None],
        waiting: Callable[[], int], stopped: type[CalfsmError]) -> None:
    """Four waiters queued by ``queue(4, cancel_flags=...)`` behind held capacity: the two
    at the back are cancelled and ``wake_all()`` must reach them (Cancelled) while the
    front two stay queued; then ``stop()`` (shutdown, retire) must reach those two
    (``stopped``). Capacity wakes only the head, so this is what reaches the others."""
    flags = [threading.Event() for _ in range(4)]
    threads, outcomes = queue(4, cancel_flags=flags)
    flags[2].set()
    flags[3].set()
    wake_all()
    join_all(threads[2:])
    assert sorted(i for i, _ in outcomes) == [2, 3]
    assert all(isinstance(o, Cancelled) for _, o in outcomes)
    assert waiting() == 2
    stop()
    join_all(threads[:2])
    assert len(outcomes) == 4 and all(isinstance(o, stopped) for _, o in outcomes[2:])
    assert waiting() == 0
