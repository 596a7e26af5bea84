"""Shared by the buffer pool tests: a fake driver with just the buffer half of the
Driver protocol, and a pool built on it for the tiny model's prefill and decode."""

from __future__ import annotations

from typing import Any

import numpy as np

from calfsm.drivers.base import EngineSlot
from calfsm.engine.buffers import BufferPool
from calfsm.manifest import TaskKind, builtin_manifest
from calfsm.runtime.sync import THREADS

TINY = builtin_manifest("tiny")
PREFILL = TINY.submodel(TaskKind.PREFILL_IDS)
DECODE = TINY.submodel(TaskKind.DECODE)


class FakeDriver:
    """Just enough of the buffer half of the Driver protocol, recording every call."""

    name = "fake"

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.fail: dict[str, int] = {}
        self._n = 0
        self.maps: dict[tuple[int, str], np.ndarray] = {}
        self.destroyed: set[int] = set()

    def _rec(self, name: str, *args: Any) -> int:
        self.calls.append((name, args))
        return self.fail.get(name, 0)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def create_buffers(self, model, engine=EngineSlot.AUTO):
        code = self._rec("create_buffers", model, engine)
        if code:
            return code, None
        self._n += 1
        return 0, (("in", self._n), ("out", self._n))

    def destroy_buffers(self, inp, out):
        self.destroyed.add(inp[1])
        return self._rec("destroy_buffers", inp, out)

    def map_buffer(self, buf, tensor, host):
        code = self._rec("map_buffer", buf, tensor)
        if not code:
            self.maps[(buf[1], tensor)] = host
        return code

    def slice_tensor(self, buf, tensor, offset, size):
        return self._rec("slice_tensor", buf, tensor, offset, size)

    def undo_slice(self, buf, tensor):
        return self._rec("undo_slice", buf, tensor)

    def set_csr(self, inp, name, value):
        return self._rec("set_csr", inp, name, value)

    def set_kv_seq(self, inp, seq_id):
        return self._rec("set_kv_seq", inp, seq_id)


MODELS = {TaskKind.PREFILL_IDS: ("prefill-handle", PREFILL),
          TaskKind.DECODE: ("decode-handle", DECODE)}


def make_pool(driver=None, generation=0, **kw) -> tuple[FakeDriver, BufferPool]:
    driver = driver or FakeDriver()
    return driver, BufferPool.build(driver, generation, MODELS, **kw, sync=THREADS)
