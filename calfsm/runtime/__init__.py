"""Who drives the engine: worker threads, or a test's step scheduler on a virtual clock.

The blocking waits (:mod:`calfsm.runtime.waits`), the cross-thread wake-ups and the thread
primitives the engine is built with (:mod:`calfsm.runtime.sync`) live here, not in the
engine."""

from calfsm.runtime.drive import StepRuntime, Steps, ThreadRuntime
from calfsm.runtime.stepper import StepScheduler

__all__ = ["StepRuntime", "StepScheduler", "Steps", "ThreadRuntime"]
