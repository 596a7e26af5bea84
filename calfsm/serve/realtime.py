"""The simulated device in real time, in one line: ``realtime_sim(manifest)``.

The simulated driver's default clock is virtual: nothing sleeps and time moves only when
a job finishes, which is what tests want and what a server cannot use (deadlines, the
watchdog and the clients all live in wall time). :func:`realtime_sim` gives a
:class:`~calfsm.drivers.sim.SimDriver` on the wall clock with a fixed latency (10 ms per
decode, 50 us per prefill token unless told) and no trace, so it holds no memory per job.
``calfsm serve`` runs on it by default.
"""

from __future__ import annotations

from calfsm.clock import RealClock
from calfsm.drivers.faults import FaultPlan
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.errors import InvalidArgument
from calfsm.manifest import Manifest

__all__ = ["realtime_sim"]


def realtime_sim(manifest: Manifest, *, decode_ms: float = 10.0,
                 prefill_token_us: float = 50.0, seed: int = 0,
                 faults: FaultPlan | None = None,
                 batch_row_share: float = 0.0, shape_cost: str = "graph") -> SimDriver:
    """A simulated device for ``manifest`` that takes real time: ``decode_ms`` per decode
    step and ``prefill_token_us`` per prefilled token, on ``time.monotonic``; a batch
    decode step of R rows ``decode_ms * (1 + batch_row_share * (R - 1))``, where R is the
    graph's whole batch (``shape_cost="graph"``, a static calbin: the default) or the
    rows the step carries (``"rows"``, a dynamic-shape device)."""
    for name, value in (("decode_ms", decode_ms), ("prefill_token_us", prefill_token_us)):
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not 0 <= value < float("inf"):
            raise InvalidArgument(f"{name} must be a finite number >= 0, got {value!r}",
                                  stage="config")
    return SimDriver(manifest, seed=seed, faults=faults, clock=RealClock(), trace=False,
                     latency=LatencyModel.fixed(decode_s=decode_ms * 1e-3,
                                                prefill_per_token_s=prefill_token_us * 1e-6,
                                                batch_row_share=batch_row_share,
                                                shape_cost=shape_cost))
