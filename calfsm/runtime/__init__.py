"""Who drives the engine: worker threads, or a test's step scheduler on a virtual clock.

The blocking waits and the cross-thread wake-ups live here, not in the engine."""

from calfsm.runtime.drive import StepRuntime, Steps, ThreadRuntime
from calfsm.runtime.stepper import StepScheduler

__all__ = ["StepRuntime", "StepScheduler", "Steps", "ThreadRuntime"]
