"""StepScheduler: drive a step-mode executor one step at a time, deterministically.

A step-mode executor (``ExecutorConfig(threaded=False)``) starts no thread. Its work is
a set of *actions* on its public :class:`~calfsm.runtime.drive.Steps` (``executor.steps``),
each one bounded step of the same code the threads run:

``admit``     admit the head job waiting for KV or a buffer (FIFO)
``submit``    submit the head of the submit queue (the only ``infer`` caller)
``complete``  wait for the oldest submitted job (the only ``wait`` caller)
``recover``   run recovery once the drain condition holds
``deferred``  run one piece of deferred work (a stream's replay, a sequence's release)
``expire``    fail the jobs whose admission or queue deadline has passed
``advance``   nothing else can move: jump the virtual clock to the next timer

At each step the scheduler picks one enabled action with a seeded ``random.Random`` (an
expired deadline is a timer and always fires first), so a seed *is* an interleaving: the
same seed replays it exactly, and hypothesis can search seeds. ``log`` records the
actions taken.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

__all__ = ["StepScheduler"]


class StepScheduler:
    """Chooses and runs the enabled actions of a step-mode executor, one per :meth:`step`.
    """

    def __init__(self, executor: Any, seed: int = 0) -> None:
        if executor.config.threaded:
            raise ValueError("StepScheduler drives a step-mode executor "
                             "(ExecutorConfig(threaded=False))")
        self._init(executor.steps, seed, repr(executor))

    @classmethod
    def for_steps(cls, steps: Any, seed: int = 0) -> StepScheduler:
        """A scheduler over a :class:`~calfsm.runtime.drive.Steps` directly."""
        self = cls.__new__(cls)
        self._init(steps, seed, "step-mode executor")
        return self

    def _init(self, steps: Any, seed: int, name: str) -> None:
        self.steps = steps
        self.rng = random.Random(seed)
        self.log: list[str] = []
        self._name = name
        self._admit_blocked_at: int | None = None

    # ---- which actions may run -----------------------------------------------------
    def enabled(self) -> list[str]:
        s = self.steps
        acts = s.enabled()
        # a parked job that could not move is retried only once something changed
        if self._admit_blocked_at is not None and "admit" in acts \
                and self._admit_blocked_at == s.admission_fingerprint():
            acts.remove("admit")
        return acts

    # ---- running -------------------------------------------------------------------
    def step(self) -> str | None:
        """Run one enabled action (or a clock jump). None when nothing can ever move."""
        acts = self.enabled()       # a subclass may hold actions back (tests do)
        if not acts:
            return self._advance()
        if acts[0] == "expire":          # a timer: it fires before anything else may run
            act = "expire"
        else:
            act = acts[0] if len(acts) == 1 else self.rng.choice(acts)
        s = self.steps
        if act == "admit":
            if not s.admit():
                self._admit_blocked_at = s.admission_fingerprint()
        elif act == "submit":
            s.submit()
        elif act == "complete":
            s.complete()
        elif act == "recover":
            s.recover()
        elif act == "deferred":
            s.run_deferred()
        elif act == "expire":
            s.expire()
            self._admit_blocked_at = None
        self.log.append(act)
        return act

    def _advance(self) -> str | None:
        """Jump the virtual clock to the next thing that will happen by itself."""
        clock = self.steps.clock
        if not clock.virtual:
            return None
        t = self.steps.next_timer()
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
                                   f"enabled and no deadline ahead ({self._name})")
            steps += 1
            if steps >= max_steps:
                raise RuntimeError(f"predicate not reached within {max_steps} steps")
        return steps

    def run_until_idle(self, max_steps: int = 100_000) -> int:
        """Step until no job is waiting, queued or on the device."""
        return self.run_until(self.steps.idle, max_steps)
