"""Doorbell: ring/wait semantics the pipeline threads rely on."""

from __future__ import annotations

import threading

from calfsm.runtime.doorbell import Doorbell


def test_a_ring_before_the_wait_is_not_lost() -> None:
    bell = Doorbell()
    bell.ring()
    assert bell.wait(0) is True
    assert bell.wait(0) is False            # consumed


def test_rings_coalesce() -> None:
    bell = Doorbell()
    for _ in range(5):
        bell.ring()
    assert bell.wait(0) is True
    assert bell.wait(0) is False


def test_wait_times_out_unrung() -> None:
    bell = Doorbell()
    assert bell.wait(0.01) is False
    assert bell.wait(-1) is False


def test_a_ring_from_another_thread_wakes_the_waiter() -> None:
    bell = Doorbell()
    woke: list[bool] = []
    t = threading.Thread(target=lambda: woke.append(bell.wait(None)))
    t.start()
    bell.ring()
    t.join(10.0)
    assert not t.is_alive()
    assert woke == [True]
