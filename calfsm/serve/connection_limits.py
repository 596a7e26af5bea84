"""The per-connection limits of ``calfsm serve``'s HTTP server, as a record: kept apart
from :mod:`calfsm.serve.connections` (which needs uvicorn) so that ``calfsm serve
--help`` can show their defaults without the server extra installed."""

from __future__ import annotations

import attrs

from calfsm.serve.fields import count, positive

__all__ = ["ConnectionLimits"]


@attrs.frozen
class ConnectionLimits:
    """Per-connection limits of the HTTP server (wall seconds, bytes); each is explained
    in :mod:`calfsm.serve.connections`."""

    header_timeout_s: float = attrs.field(default=10.0, validator=positive)
    body_timeout_s: float = attrs.field(default=30.0, validator=positive)
    keep_alive_s: float = attrs.field(default=75.0, validator=positive)
    max_header_bytes: int = attrs.field(default=16 << 10, validator=count)
    max_connections: int = attrs.field(default=1000, validator=count)
