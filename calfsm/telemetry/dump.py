"""The dump sink (spec S12): a job's inputs and outputs written to disk, on request only.

The defect it replaces dumped tensors to a hard-coded home directory. This sink is off
by default (``ExecutorConfig.dump`` is None), has no default directory (a
:class:`DumpConfig` without one is a configuration error), and writes only:

- the jobs whose id was selected (``DumpConfig.job_ids``, or :meth:`DumpSink.watch`
  while the executor runs), and
- the jobs that failed with an error of a selected category (``DumpConfig.categories``,
  e.g. ``{"device"}``: every job a device fault failed).

Each dump is one NumPy ``.npz`` file named ``job-<job id>-gen-<generation>.npz`` — from
those two numbers only, never from anything a request carries — holding ``meta`` (a
JSON string: outcome, kind, sequence, positions, timings, the error's fields), the
request's ``tokens`` and ``positions`` (embeddings of a non-NumPy dtype as their raw
bits, named in ``meta``), the float32 ``logits`` of a job that succeeded, and the raw
BF16 ``output_bits`` (uint16) of a job whose output the executor judged bad.

Bounds: at most ``max_files`` files and ``max_bytes`` bytes in the directory, counting
the dump files already there when the sink starts. When the next file would pass
either bound, **writing stops**: the file is not written (counted ``dropped``, logged
once) and nothing already written is ever deleted — the first dumps of a failure are
usually the ones that show how it began, and a sink that deletes files can lose
exactly those. A file that already exists is never overwritten (counted ``dropped``):
give each process its own directory. The sink writes on the thread that ended the job
(the completion side), before the job's handle resolves; that is why it is bounded and
selective.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import threading

import attrs
import numpy as np

from calfsm.config import DumpConfig, dump_job_ids
from calfsm.engine.observe import JobEnded, Observer
from calfsm.errors import InvalidArgument

__all__ = ["DumpConfig", "DumpSink", "DumpStats", "dump_name"]

log = logging.getLogger("calfsm.dump")

_NAME = re.compile(r"job-(\d+)-gen-(\d+)\.npz")


def dump_name(job_id: int, generation: int) -> str:
    """The file name of one job's dump: its id and generation, nothing else."""
    return f"job-{int(job_id)}-gen-{int(generation)}.npz"


def _bad(msg: str) -> InvalidArgument:
    return InvalidArgument(msg, stage="config")


@attrs.frozen
class DumpStats:
    """What the sink did: files and bytes in its directory (its own and those it found),
    files written, dumps not written (a bound reached, a name taken) and write errors."""

    files: int
    bytes: int
    written: int
    dropped: int
    errors: int


class DumpSink(Observer):
    """Writes the selected jobs of an executor to ``config.directory`` (an observer: the
    executor adds it when ``ExecutorConfig.dump`` is set, or call
    ``executor.add_observer(DumpSink(config))`` yourself)."""

    def __init__(self, config: DumpConfig) -> None:
        if not isinstance(config, DumpConfig):
            raise _bad(f"DumpSink takes a DumpConfig, got {type(config).__name__}")
        self.config = config
        self.directory = config.directory
        self._lock = threading.Lock()
        self._watch = set(config.job_ids)
        self._written = self._dropped = self._errors = 0
        self._full_logged = False
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._files, self._bytes = self._existing()
        except OSError as e:
            raise _bad(f"dump directory {str(self.directory)!r} is not usable: {e}") from e

    def _existing(self) -> tuple[int, int]:
        """Dump files already in the directory count against the bounds."""
        files = size = 0
        for entry in os.scandir(self.directory):
            if entry.is_file(follow_symlinks=False) and _NAME.fullmatch(entry.name):
                files += 1
                size += entry.stat(follow_symlinks=False).st_size
        return files, size

    def watch(self, job_id: int) -> None:
        """Dump job ``job_id`` too when it ends (e.g. ``sink.watch(handle.job_id)``)."""
        (job_id,) = dump_job_ids((job_id,))
        with self._lock:
            self._watch.add(job_id)

    def wants(self, event: JobEnded) -> bool:
        """Whether ``event``'s job is selected (a discarded prepared step never is)."""
        if event.outcome == "discarded":
            return False
        if event.job_id in self._watch:
            return True
        err = event.error
        return err is not None and err.category.value in self.config.categories

    def stats(self) -> DumpStats:
        with self._lock:
            return DumpStats(self._files, self._bytes, self._written, self._dropped,
                             self._errors)

    # ---- the observer --------------------------------------------------------------
    def job_ended(self, event: JobEnded) -> None:
        if not self.wants(event):
            return
        data = _encode(event)
        name = dump_name(event.job_id, event.generation)
        with self._lock:
            cfg = self.config
            if self._files + 1 > cfg.max_files or self._bytes + len(data) > cfg.max_bytes:
                self._dropped += 1
                if not self._full_logged:
                    self._full_logged = True
                    log.warning("dump directory %s is full (%s files, %s bytes; bounds %s "
                                "files, %s bytes): writing stops", self.directory,
                                self._files, self._bytes, cfg.max_files, cfg.max_bytes,
                                extra={"job_id": event.job_id, "stage": "dump"})
                return
            path = self.directory / name
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                self._dropped += 1
                log.warning("dump %s already exists; not overwritten", path,
                            extra={"job_id": event.job_id, "stage": "dump"})
                return
            except OSError as e:
                self._errors += 1
                log.warning("cannot create dump %s: %s", path, e,
                            extra={"job_id": event.job_id, "stage": "dump"})
                return
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            except OSError as e:
                self._errors += 1
                log.warning("writing dump %s failed: %s", path, e,
                            extra={"job_id": event.job_id, "stage": "dump"})
                path.unlink(missing_ok=True)
                return
            self._files += 1
            self._bytes += len(data)
            self._written += 1
            self._watch.discard(event.job_id)


def _raw(a: np.ndarray) -> tuple[np.ndarray, str]:
    """An array NumPy can save and load without extra packages, and its dtype's name
    (a bfloat16 array goes as its bits)."""
    a = np.asarray(a)
    if a.dtype.kind in "biuf":
        return a, a.dtype.name
    return a.view(f"u{a.dtype.itemsize}"), a.dtype.name


def _encode(event: JobEnded) -> bytes:
    req = event.request
    tokens, tokens_dtype = _raw(req.tokens)
    arrays: dict[str, np.ndarray] = {"tokens": tokens,
                                     "positions": np.asarray(req.positions)}
    if event.result is not None:
        arrays["logits"] = np.asarray(event.result.logits, dtype=np.float32)
    if event.output is not None:
        arrays["output_bits"] = _raw(event.output)[0]
    err = event.error
    t = event.timings
    meta = {
        "job_id": event.job_id, "generation": event.generation, "seq_id": event.seq_id,
        "kind": event.kind.value, "outcome": event.outcome,
        "past_len": req.past_len, "token_count": req.token_count,
        "tokens_dtype": tokens_dtype, "deadline_s": req.deadline_s,
        "priority": req.priority,
        "timings": attrs.asdict(t),
        "error": None if err is None else {
            "type": type(err).__name__, "category": err.category.value,
            "message": err.message, "stage": err.stage, "calrt_code": err.calrt_code,
            "retryable": err.retryable},
    }
    buf = io.BytesIO()
    np.savez(buf, meta=np.array(json.dumps(meta)), **arrays)
    return buf.getvalue()
