"""The KV-cache adapter: llama.cpp's memory operations, only those calfsm really does.

The old adapter (``llama-kv-cache-calrt-adapter``) had empty bodies that callers took
for success. Here every operation either does its work or raises
:class:`~calfsm.errors.Unsupported` with the reason, and :data:`KV_OPERATIONS` (what
:meth:`LlamaMemory.capabilities` lists) says which is which, so an upper layer turns its
features off before it calls them.

What a sequence holds is the executor's KV coordinator's committed length
(:meth:`~calfsm.engine.kv.KvCoordinator.sequence_length`), the one record of it: positions
``0 .. n-1``. Removing a tail (``seq_rm(s, p0, -1)``) releases the device KV from
``p0`` on (:meth:`~calfsm.engine.kv.KvCoordinator.truncate_sequence`); the next batch goes on at
``p0`` and its prefill writes those positions again, reading only position ``p0 - 1``,
which is kept — on every driver, so the result equals a fresh run of the shorter
prompt (``tests/llama/test_llama.py`` checks it against the reference model on the simulated
device and the native emulator). Clearing releases everything (``kv_release(seq, 0)``).

A sequence whose KV calfsm cannot vouch for (lost in a device reset, or a job whose
outcome is unknown) holds nothing usable: it reports no positions (``seq_pos_max`` -1),
and the next batch must start at position 0; that batch first clears it.

Copying, keeping, shifting and dividing positions, and saving or loading the state,
need device operations CalRT 0.7.6 does not have.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from calfsm.engine.kv import KvCoordinator, SeqState
from calfsm.errors import InvalidArgument, Unavailable, Unsupported

if TYPE_CHECKING:
    from calfsm.executor import DeviceExecutor

__all__ = ["KV_OPERATIONS", "LlamaMemory"]

_SHIFT = ("the graph writes each position's KV where the host says and CalRT offers no "
          "call to move cached keys to other positions (a RoPE shift on the device); "
          "can_shift() is False")
_STATE = ("the device KV cannot be read back to the host or written from it (the CalRT "
          "C ABI has no call for either), so a state can be neither saved nor loaded; "
          "keep the tokens and prefill them again")

#: llama.cpp memory operation -> None if calfsm does it, else why it cannot
KV_OPERATIONS: Mapping[str, str | None] = {
    "clear": None,
    "seq_rm": None,
    "seq_pos_min": None,
    "seq_pos_max": None,
    "can_shift": None,
    "seq_cp": ("CalRT 0.7.6 has no call that copies or shares KV between sequences "
               "(kv_apply/kv_release size one sequence's own cache); prefill the prompt "
               "on the destination sequence instead"),
    "seq_keep": ("calfsm clears a sequence only when it is named, never as a side effect; "
                 "clear each other sequence with seq_rm(seq_id, -1, -1)"),
    "seq_add": "shifting positions: " + _SHIFT,
    "seq_div": "dividing positions: " + _SHIFT,
    "state_get_size": _STATE,
    "state_get_data": _STATE,
    "state_set_data": _STATE,
    "state_save_file": _STATE,
    "state_load_file": _STATE,
    "state_seq_get_size": _STATE,
    "state_seq_get_data": _STATE,
    "state_seq_set_data": _STATE,
    "state_seq_save_file": _STATE,
    "state_seq_load_file": _STATE,
}

_STAGE = "llama_memory"


def _unsupported(name: str) -> Callable[..., NoReturn]:
    reason = KV_OPERATIONS[name]

    def op(self: LlamaMemory, *args: Any, **kwargs: Any) -> NoReturn:
        raise Unsupported(f"{name} is not supported: {reason}", stage=_STAGE)

    op.__name__ = name
    op.__doc__ = f"Raises Unsupported: {reason}."
    return op


class LlamaMemory:
    """The memory (KV cache) of a :class:`~calfsm.llama.LlamaContext`: llama.cpp's
    ``llama_memory_*`` operations over the context's sequences ``0 .. n_seq_max-1``."""

    def __init__(self, executor: DeviceExecutor, seq_ids: tuple[int, ...],
                 lock: threading.RLock) -> None:
        self._executor = executor
        self._ids = seq_ids          # llama seq id -> calfsm seq id
        self._lock = lock

    # ---- what is offered ------------------------------------------------------------
    @staticmethod
    def capabilities() -> tuple[str, ...]:
        """The operations that work (the others raise Unsupported)."""
        return tuple(k for k, why in KV_OPERATIONS.items() if why is None)

    @staticmethod
    def supports(name: str) -> bool:
        return KV_OPERATIONS.get(name, "unknown") is None

    @staticmethod
    def can_shift() -> bool:
        """``llama_memory_can_shift``: positions cannot be shifted (see ``seq_add``)."""
        return False

    @property
    def seq_ids(self) -> tuple[int, ...]:
        """The executor's sequence id of each llama sequence id (its index)."""
        return self._ids

    # ---- the record -----------------------------------------------------------------
    def _kv(self) -> KvCoordinator:
        epoch = self._executor.epoch
        if epoch is None:
            raise Unavailable("the executor has no configured model", stage=_STAGE)
        return epoch.kv

    def device_seq(self, seq_id: int) -> int:
        """The calfsm sequence id behind llama sequence ``seq_id``."""
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) \
                or not 0 <= seq_id < len(self._ids):
            raise InvalidArgument(f"seq_id must be one of this context's sequences "
                                  f"0..{len(self._ids) - 1}, got {seq_id!r}", stage=_STAGE)
        return self._ids[seq_id]

    def n_held(self, seq_id: int) -> int:
        """Positions the sequence holds (0 for one whose KV calfsm cannot vouch for)."""
        kv, dev = self._kv(), self.device_seq(seq_id)
        if kv.sequence_state(dev) is SeqState.UNKNOWN:
            return 0
        return kv.sequence_length(dev)

    def is_lost(self, seq_id: int) -> bool:
        """Whether the sequence's KV is Unknown (it must start again at position 0)."""
        return self._kv().sequence_state(self.device_seq(seq_id)) is SeqState.UNKNOWN

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position held (0), or -1 when the sequence is empty."""
        with self._lock:
            return 0 if self.n_held(seq_id) else -1

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position held, or -1 when the sequence is empty."""
        with self._lock:
            return self.n_held(seq_id) - 1

    # ---- removing -------------------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Remove positions ``[p0, p1)`` of ``seq_id`` (-1: every sequence; ``p0 < 0``:
        0; ``p1 < 0``: to the end). True when done — a tail, the whole sequence, or a
        range it does not hold; False, changing nothing, for a range that would leave a
        hole or drop the head (llama.cpp's "partial removal not possible": the caller
        clears the sequence instead)."""
        for name, v in (("p0", p0), ("p1", p1)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidArgument(f"{name} must be an integer, got {v!r}", stage=_STAGE)
        with self._lock:
            if seq_id == -1:
                return all([self.seq_rm(s, p0, p1) for s in range(len(self._ids))])
            start = max(p0, 0)
            end = math.inf if p1 < 0 else p1
            held = self.n_held(seq_id)
            if start == 0 and end >= held:
                self._executor.reset_sequence(self.device_seq(seq_id))
                return True
            if start >= held or end <= start:
                return True               # nothing of it is held
            if end < held:
                return False              # a hole, or the head: not possible
            self.truncate(seq_id, start)
            return True

    def truncate(self, seq_id: int, keep: int) -> None:
        """Keep positions ``0 .. keep-1`` of the sequence, release the rest."""
        with self._lock:
            self._kv().truncate_sequence(self.device_seq(seq_id), keep)

    def clear(self, data: bool = True) -> None:
        """``llama_memory_clear``: empty every sequence of the context (``data`` is
        accepted for llama.cpp's signature; the KV is always released)."""
        with self._lock:
            for s in range(len(self._ids)):
                self._executor.reset_sequence(self._ids[s])

    # ---- not offered (KV_OPERATIONS says why) ---------------------------------------
    seq_cp = _unsupported("seq_cp")
    seq_keep = _unsupported("seq_keep")
    seq_add = _unsupported("seq_add")
    seq_div = _unsupported("seq_div")
    state_get_size = _unsupported("state_get_size")
    state_get_data = _unsupported("state_get_data")
    state_set_data = _unsupported("state_set_data")
    state_save_file = _unsupported("state_save_file")
    state_load_file = _unsupported("state_load_file")
    state_seq_get_size = _unsupported("state_seq_get_size")
    state_seq_get_data = _unsupported("state_seq_get_data")
    state_seq_set_data = _unsupported("state_seq_set_data")
    state_seq_save_file = _unsupported("state_seq_save_file")
    state_seq_load_file = _unsupported("state_seq_load_file")
