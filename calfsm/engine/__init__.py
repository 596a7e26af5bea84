"""The engine: the sans-thread core that takes a job from admission to its one end.

Admission, the parked queue, submission, completion and read-back, logits, outcomes,
overlap, batch rows, the KV and buffer books, jobs, epochs, the lifecycle, the fault
policy, step costs and observers. Nothing here starts a thread, waits or reads a clock of
its own: the runtime (:mod:`calfsm.runtime.drive`) drives its steps, and the generation API
(:mod:`calfsm.generate`) is built on it, never the other way round."""
