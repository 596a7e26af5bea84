"""StepScheduler: drive a step-mode executor one step at a time, deterministically.

A step-mode executor (``ExecutorConfig(threaded=False)``) starts no thread. Its work is
a set of *actions*, each one bounded step of the same code the threads run:

``admit``     admit the head job waiting for KV or a buffer (FIFO)
``submit``    submit the head of the submit queue (the only ``infer`` caller)
``complete``  wait for the oldest submitted job (the only ``wait`` caller)
``recover``   run recovery once the drain condition holds
``expire``    fail the jobs whose admission or queue deadline has passed
``advance``   nothing else can move: jump the virtual clock to the next deadline

At each step the scheduler picks one enabled action with a seeded ``random.Random`` (an
expired deadline is a timer and always fires first), so a seed *is* an interleaving: the
same seed replays it exactly, and hypothesis can search seeds. ``log`` records the
actions taken.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from calfsm.machines.lifecycle import LifecycleState

if TYPE_CHECKING:
    from calfsm.executor import DeviceExecutor

__all__ = ["StepScheduler"]


class StepScheduler:
    """Chooses and runs the executor's enabled actions, one per :meth:`step`."""

    def __init__(self, executor: DeviceExecutor, seed: int = 0) -> None:
        if executor.config.threaded:
            raise ValueError("StepScheduler drives a step-mode executor "
                             "(ExecutorConfig(threaded=False))")
        self.ex = executor
        self.rng = random.Random(seed)
        self.log: list[str] = []
        self._admit_blocked_at: tuple[int, int] | None = None

    # ---- which actions may run -----------------------------------------------------
    def enabled(self) -> list[str]:
        ex = self.ex
        acts = []
        if ex._next_deadline() <= ex.clock.now():
            acts.append("expire")
        if ex._parked and self._admit_blocked_at != self._progress_key():
            acts.append("admit")
        if ex._submittable_locked():       # step mode: no other thread holds it
            acts.append("submit")
        if ex._complete_q:
            acts.append("complete")
        if ex.faults.recovery_pending and ex.faults.drained() \
                and ex.lifecycle_state == LifecycleState.DRAINING:
            acts.append("recover")
        return acts

    def _progress_key(self) -> tuple[int, int]:
        """A fingerprint of what could let a blocked admission proceed (KV books, pool,
        generation): ``admit`` is re-enabled only when it changed, so a parked job that
        cannot move does not spin the scheduler."""
        ex = self.ex
        stats = ex.epoch.kv.stats() if ex.epoch is not None else None
        return (len(ex._parked), hash((stats, ex.epoch.pool.stats() if ex.epoch else None,
                                       ex.generation)))

    # ---- running -------------------------------------------------------------------
    def step(self) -> str | None:
        """Run one enabled action (or a clock jump). None when nothing can ever move."""
        acts = self.enabled()
        if not acts:
            return self._advance()
        if acts[0] == "expire":          # a timer: it fires before anything else may run
            act = "expire"
        else:
            act = acts[0] if len(acts) == 1 else self.rng.choice(acts)
        ex = self.ex
        if act == "admit":
            if not ex._admit_parked():
                self._admit_blocked_at = self._progress_key()
        elif act == "submit":
            ex._submit_next()
        elif act == "complete":
            ex._complete_next()
        elif act == "recover":
            ex.faults.recover()
        elif act == "expire":
            ex._expire_waiting()
            self._admit_blocked_at = None
        self.log.append(act)
        return act

    def _advance(self) -> str | None:
        """Jump the virtual clock to the next thing that will happen by itself."""
        ex = self.ex
        clock = ex.clock
        if not clock.virtual:
            return None
        targets = [ex._next_deadline()]
        if ex.faults.recovery_pending:
            targets.append(ex.faults._drain_started + ex.config.recovery.grace_period_s)
        if ex.faults.backoff_until > clock.now():
            targets.append(ex.faults.backoff_until)
        t = min(targets)
        if math.isinf(t):
            return None
        clock.advance_to(t)
        self._admit_blocked_at = None
        self.log.append("advance")
        return "advance"

    def run_until(self, predicate: Callable[[], bool], max_steps: int = 100_000) -> int:
        """Step until ``predicate()`` holds; raise if the system can no longer move."""
        steps = 0
        while not predicate():
            if self.step() is None:
                raise RuntimeError(f"step scheduler stuck after {steps} steps: nothing "
                                   f"enabled and no deadline ahead ({self.ex!r})")
            steps += 1
            if steps >= max_steps:
                raise RuntimeError(f"predicate not reached within {max_steps} steps")
        return steps

    def run_until_idle(self, max_steps: int = 100_000) -> int:
        """Step until no job is waiting, queued or on the device."""
        ex = self.ex
        return self.run_until(
            lambda: not (ex._parked or ex._submit_q or ex._complete_q or ex._on_device
                         or (ex.faults.recovery_pending
                             and ex.lifecycle_state == LifecycleState.DRAINING)),
            max_steps)
