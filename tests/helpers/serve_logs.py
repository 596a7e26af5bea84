"""What the server logs while a test runs: the records of the ``calfsm`` and ``uvicorn``
loggers (uvicorn's do not reach the root logger, so pytest's ``caplog`` misses them)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["Records"]


class Records(logging.Handler):
    """Every record of the ``calfsm`` and ``uvicorn`` loggers while a test runs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def matching(self, text: str) -> list[logging.LogRecord]:
        return [r for r in self.records if text in r.getMessage()]

    def assert_no_traceback(self) -> None:
        bad = [(r.name, r.levelname, r.getMessage()) for r in self.records
               if r.exc_info or r.levelno >= logging.ERROR]
        assert not bad, bad


    @classmethod
    @contextlib.contextmanager
    def capture(cls) -> Iterator[Records]:
        """Collect the records while the block runs (``calfsm`` at DEBUG)."""
        handler = cls()
        loggers = [logging.getLogger(n) for n in ("calfsm", "uvicorn")]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.addHandler(handler)
        loggers[0].setLevel(logging.DEBUG)
        try:
            yield handler
        finally:
            for lg, level in zip(loggers, levels):
                lg.removeHandler(handler)
                lg.setLevel(level)
