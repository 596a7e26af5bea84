"""The engine: the sans-thread core that takes a job from admission to its one end.

Admission, the parked queue, submission, completion and read-back, logits, outcomes,
overlap, batch rows, the KV and buffer books, jobs, epochs, the lifecycle, the fault
policy, step costs and observers. Nothing here starts a thread, waits or reads a clock of
its own, nor imports ``threading`` or ``asyncio``: its locks come from the
:class:`~calfsm.engine.sync.Sync` it is built with, the runtime (:mod:`calfsm.runtime.drive`)
drives its steps and does the waiting (:mod:`calfsm.runtime.waits`), and the generation API
(:mod:`calfsm.generate`) is built on it, never the other way round."""
