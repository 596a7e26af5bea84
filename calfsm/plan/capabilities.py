"""The vendor questions and the evidence that answers them (spec section 14).

Theory of operation
-------------------
Some properties of a device cannot be known from any source code: whether its parallel
mode is thread safe and how many jobs it really keeps in flight, whether Ping and Pong
overlap transfers with compute, whether a timed-out job can be cancelled safely, whether
a failed wait leaves the KV partly written, what each reset kind does. calfsm names each
such property a *capability* (:data:`CAPABILITIES`) and ships a runner script per
question (``examples/vendor/``) that asks the device and writes an *evidence file*: the
device, its runtime version, the calbin, the raw observations and a verdict per
capability, as JSON (:class:`Evidence`).

:class:`EvidenceStore` reads a directory of such files and answers, for one capability
on one device and runtime version, a :class:`Capability` with a :class:`Level`:

- ``PROVEN``: the newest evidence for this device, runtime version (and calbin, when
  asked) says the capability holds;
- ``FAILED``: that evidence says it does not hold;
- ``CLAIMED``: no such evidence, but the driver declares the feature
  (:class:`~calfsm.drivers.base.Capabilities`) — a claim, which is not proof;
- ``UNKNOWN``: neither.

Evidence from another device or runtime version, for another calbin, or older than a
maximum age is *stale*: it proves nothing here, and the reason says so; nor does evidence
of a runner that could not make every observation (``complete`` false). Features that
depend on a capability (two in flight) are enabled only when it is ``PROVEN``.

One directory: :func:`evidence_dir` is the one rule every reader and writer follows
(the executor, ``calfsm capabilities``, ``calfsm run``, ``calfsm serve`` and the
runners' ``--out``): an explicit directory, else ``$CALFSM_EVIDENCE_DIR``, else
``./evidence`` (:data:`DEFAULT_DIR`) of the working directory (docs/capabilities.md says
why). A file in it that cannot be evidence — malformed, larger than
:data:`MAX_FILE_BYTES`, nested too deep, or not a regular file at all (a FIFO, a
directory, a symlink to a device) — proves nothing and is reported with its reason; it
never raises and never blocks the reader.
"""

from __future__ import annotations

import enum
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from calfsm.drivers.base import Capabilities, Driver, ResetKind
from calfsm.errors import InvalidArgument
from calfsm.util.boundedio import load_json, read_regular, reason

__all__ = ["CAPABILITIES", "DEFAULT_DIR", "DIR_RULE", "ENV_DIR", "MAX_FILE_BYTES", "SCHEMA",
           "Capability", "CapabilityInfo", "Evidence", "EvidenceStore", "Level", "Verdict",
           "capability_info", "device_identity", "evidence_dir", "format_age"]

#: the environment variable naming the evidence directory
ENV_DIR = "CALFSM_EVIDENCE_DIR"
#: the evidence directory when neither an argument nor ``$CALFSM_EVIDENCE_DIR`` names
#: one: relative to the working directory (docs/capabilities.md, "One directory")
DEFAULT_DIR = "evidence"
#: the rule of :func:`evidence_dir` in words, for every ``--evidence-dir``/``--out`` help
DIR_RULE = f"${ENV_DIR} when set, else ./{DEFAULT_DIR} of the working directory"
#: the largest evidence file read (the biggest a runner writes, the overlap runner's with
#: its per-job timeline, is ~15 KiB); a larger one is reported, not read
MAX_FILE_BYTES = 16 << 20


def evidence_dir(directory: str | os.PathLike | None = None) -> Path:
    """The evidence directory, by the one rule: ``directory`` when given (not None, not
    empty), else ``$CALFSM_EVIDENCE_DIR`` when set and not empty, else
    :data:`DEFAULT_DIR`; as an absolute path (a relative one is taken against the
    working directory now, so a later ``chdir`` does not move it)."""
    for candidate in (directory, os.environ.get(ENV_DIR)):
        if candidate is not None and os.fspath(candidate) != "":
            return Path(candidate).absolute()
    return Path(DEFAULT_DIR).absolute()
#: the ``schema`` field every evidence file carries (other JSON files are not evidence)
SCHEMA = "calfsm-evidence/1"


class Level(enum.StrEnum):
    """How much calfsm knows about a capability on this device."""

    PROVEN = "proven"      #: a runner observed it on this device and runtime version
    FAILED = "failed"      #: a runner observed that it does not hold here
    CLAIMED = "claimed"    #: the driver declares it; nothing observed it here
    UNKNOWN = "unknown"    #: nothing says either way


@attrs.frozen
class CapabilityInfo:
    """One vendor question: its name, the question, the runner that answers it and
    whether a driver's declared :class:`Capabilities` claim it (None: no declaration
    can)."""

    name: str
    question: str
    runner: str
    declared: Callable[[Capabilities], bool] | None = attrs.field(default=None, eq=False)

    @property
    def script(self) -> str:
        return f"examples/vendor/{self.runner}.py"


def _two_engines(c: Capabilities) -> bool:
    return c.parallel_mode and c.fixed_engine_slots and c.engine_slots >= 2


def _resets(kind: ResetKind) -> Callable[[Capabilities], bool]:
    return lambda c: c.can_reset(kind)


#: every capability calfsm asks a device about, in the order ``calfsm capabilities``
#: prints them (docs/capabilities.md says how each runner decides)
CAPABILITIES: tuple[CapabilityInfo, ...] = (
    CapabilityInfo("parallel_thread_safe",
                   "parallel mode: do concurrent calls from several threads give every job "
                   "its own correct result?", "parallel_mode",
                   lambda c: c.parallel_mode),
    CapabilityInfo("parallel_two_in_flight",
                   "parallel mode: can two jobs be in flight at once on Ping and Pong, "
                   "thread safe, with a clean drain?", "parallel_mode", _two_engines),
    CapabilityInfo("parallel_drain_on_close",
                   "parallel mode: does switching it off or closing the device with jobs "
                   "in flight leave no job half-done and no late DMA?", "parallel_mode",
                   lambda c: c.parallel_mode),
    CapabilityInfo("pingpong_overlap",
                   "do jobs on Ping and Pong really overlap H2D, compute and D2H?",
                   "overlap", _two_engines),
    CapabilityInfo("safe_cancel_after_timeout",
                   "after an execution timeout, is there a cancel that ends only that job "
                   "(the other engine, the KV and the configuration untouched)?",
                   "cancel_after_timeout"),
    CapabilityInfo("timeout_recovery_by_reset",
                   "after an execution timeout, does a reset end the job and leave a device "
                   "that passes the golden?", "cancel_after_timeout",
                   lambda c: bool(c.resets)),
    CapabilityInfo("kv_no_partial_update",
                   "when submit succeeded and wait failed, is the job's KV either untouched "
                   "or fully written (never partly), and the prefix intact?",
                   "kv_after_failed_wait"),
    CapabilityInfo("batch_rows_independent",
                   "batch graphs: is every row of a batch job bit-exact the same row run "
                   "alone (no cross-talk in logits or KV), up to the real maximum rows?",
                   "batch_semantics", lambda c: c.batch_rows),
    CapabilityInfo("batch_mixed_rows",
                   "batch graphs: can rows of different lengths and positions (prefill and "
                   "decode) share one job, each correct?", "batch_semantics",
                   lambda c: c.batch_rows),
    CapabilityInfo("batch_kv_no_partial_update",
                   "batch graphs: does a failed batch job (or a failed row) leave every "
                   "row's KV untouched or fully written, never partly?", "batch_semantics",
                   lambda c: c.batch_rows),
    CapabilityInfo("graph_step_costs",
                   "shape buckets: what does a step of each graph cost, against the rows it "
                   "carries, the context (total_seq) and the prefilled tokens, measured?",
                   "step_costs"),
    CapabilityInfo("graph_kv_continuity",
                   "shape buckets: can a sequence's KV written by one graph be continued by "
                   "another, bit-exact against staying on one graph?", "step_costs"),
    *(CapabilityInfo(f"reset_{kind.value}",
                     f"reset {kind.value}: does it stop in-flight DMA, leave host buffers "
                     "alone, end both engines' jobs, and pass the golden after it (its "
                     "effect on KV and parallel mode recorded)?", "reset_semantics",
                     _resets(kind))
      for kind in ResetKind),
)

_BY_NAME = {c.name: c for c in CAPABILITIES}


def capability_info(name: str) -> CapabilityInfo:
    """The :class:`CapabilityInfo` of ``name``; an unknown name is a misuse."""
    info = _BY_NAME.get(name) if isinstance(name, str) else None
    if info is None:
        raise InvalidArgument(f"unknown capability {name!r} (known: "
                              f"{', '.join(_BY_NAME)})", stage="capabilities")
    return info


def device_identity(driver: Driver) -> str:
    """The device an evidence file is about, as the runners and the executor name it:
    the driver name, and for a driver over a CalRT library the library's file name
    (``calrt:libcalrt_emu.so`` is the emulator, anything else a vendor shim)."""
    library = getattr(driver, "library_path", None)
    return f"{driver.name}:{Path(library).name}" if library else str(driver.name)


@attrs.frozen
class Verdict:
    """A runner's answer for one capability: whether it holds, and why, in one sentence."""

    holds: bool
    reason: str


def _verdicts(value: Any) -> dict[str, Verdict]:
    if not isinstance(value, Mapping):
        raise ValueError("'verdicts' must be an object")
    out = {}
    for name, v in value.items():
        if not (isinstance(v, Mapping) and isinstance(v.get("holds"), bool)
                and isinstance(v.get("reason"), str)):
            raise ValueError(f"verdict {name!r} needs a bool 'holds' and a str 'reason'")
        out[str(name)] = Verdict(v["holds"], v["reason"])
    return out


def _field(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str,
           default: Any) -> Any:
    """``data[key]`` (``default`` when absent), which must be a ``kind``."""
    value = data.get(key, default)
    if not isinstance(value, kind):
        raise ValueError(f"{key!r} must be {what}, got {type(value).__name__}")
    return value


def _strings(data: Mapping[str, Any], key: str) -> dict[str, str]:
    value = _field(data, key, Mapping, "an object", {})
    if not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{key!r} must map names to strings")
    return {str(k): v for k, v in value.items()}


@attrs.frozen
class Evidence:
    """One runner's evidence file: what was asked of which device, what it saw, and what
    that means for each capability the runner answers.

    ``complete`` is False when the runner could not make every observation (an error, or
    a device too fast to provoke a timeout): its verdicts then cover only what it could
    decide, and the others stay unknown."""

    runner: str
    device: str
    runtime_version: str
    calbin_sha256: str
    created_unix: float
    observations: dict[str, Any]
    verdicts: dict[str, Verdict]
    complete: bool = True
    driver: str = ""
    settings: dict[str, Any] = attrs.Factory(dict)
    files: dict[str, str] = attrs.Factory(dict)

    @property
    def passed(self) -> bool:
        """Every verdict holds and every observation was made."""
        return self.complete and all(v.holds for v in self.verdicts.values())

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "runner": self.runner, "device": self.device,
                "driver": self.driver, "runtime_version": self.runtime_version,
                "calbin_sha256": self.calbin_sha256, "created_unix": self.created_unix,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                            time.gmtime(self.created_unix)),
                "complete": self.complete, "verdict": "pass" if self.passed else "fail",
                "verdicts": {k: {"holds": v.holds, "reason": v.reason}
                             for k, v in self.verdicts.items()},
                "settings": self.settings, "files": self.files,
                "observations": self.observations}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False, default=_jsonable)

    @classmethod
    def from_dict(cls, data: Any) -> Evidence:
        """An evidence record from its JSON object; ``ValueError`` naming what is wrong
        (every field is checked for its type: nothing else is ever raised)."""
        if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} object")
        for key in ("runner", "device", "runtime_version", "calbin_sha256"):
            if not isinstance(data.get(key), str):
                raise ValueError(f"{key!r} must be a string")
        created = data.get("created_unix")
        if not isinstance(created, int | float) or isinstance(created, bool) \
                or not math.isfinite(created):
            raise ValueError("'created_unix' must be a finite number")
        return cls(data["runner"], data["device"], data["runtime_version"],
                   data["calbin_sha256"], float(created),
                   dict(_field(data, "observations", Mapping, "an object", {})),
                   _verdicts(data.get("verdicts", {})),
                   _field(data, "complete", bool, "a bool", True),
                   _field(data, "driver", str, "a string", ""),
                   dict(_field(data, "settings", Mapping, "an object", {})),
                   _strings(data, "files"))

    @classmethod
    def load(cls, path: str | Path) -> Evidence:
        """The evidence file ``path``: ``ValueError`` when it is not evidence (not a
        regular file, too large, too deep, malformed), ``OSError`` when it cannot be
        opened."""
        return cls.from_dict(load_json(read_regular(path, max_bytes=MAX_FILE_BYTES)))


def _jsonable(x: Any) -> Any:
    """numpy scalars and enums in observations become plain JSON values."""
    if isinstance(x, enum.Enum):
        return x.value if isinstance(x.value, int | str) else x.name
    for conv in (int, float):
        try:
            return conv(x)
        except (TypeError, ValueError):
            pass
    return repr(x)


def format_age(seconds: float | None) -> str:
    """``"42 s ago"``, ``"3.5 h ago"``: an evidence file's age for people."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit} ago"
    return f"{seconds:.0f} s ago"


@attrs.frozen
class Capability:
    """The answer for one capability on one device: its level, why, and the evidence
    file behind it (``path`` and ``age_s`` are None when no file decided it)."""

    name: str
    level: Level
    reason: str
    path: Path | None = None
    age_s: float | None = None
    evidence: Evidence | None = attrs.field(default=None, repr=False)

    @property
    def proven(self) -> bool:
        return self.level is Level.PROVEN

    @property
    def question(self) -> str:
        return capability_info(self.name).question


class EvidenceStore:
    """The evidence files of one directory (:func:`evidence_dir` of ``directory``: the
    argument, else ``$CALFSM_EVIDENCE_DIR``, else ``./evidence``).

    Files are read on every question (there are a handful, and a runner may have just
    written one). A JSON file without the evidence ``schema`` is not evidence and is
    skipped; one that claims to be evidence but is not readable, and any ``*.json`` that
    cannot be read at all (not a regular file, too large, nested too deep, not JSON), is
    reported by :meth:`problems`, named in the reason of every answer it might have
    decided, and never proves anything. No directory at all is a store without
    evidence, not an error."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = evidence_dir(directory)

    def __repr__(self) -> str:
        return f"EvidenceStore({str(self.directory)!r})"

    def load(self) -> tuple[list[tuple[Path, Evidence]], list[str]]:
        """(path, evidence) of every readable evidence file, newest first, and one line
        per file that claims to be evidence (or may: it cannot be read) but is not
        readable evidence."""
        found: list[tuple[Path, Evidence]] = []
        problems: list[str] = []
        if not self.directory.is_dir():
            if self.directory.exists():
                problems.append(f"{self.directory}: not a directory")
            return found, problems
        for path in sorted(self.directory.glob("*.json")):
            try:
                data = load_json(read_regular(path, max_bytes=MAX_FILE_BYTES))
            except (OSError, ValueError) as e:      # boundedio.UnreadableFile included
                problems.append(f"{path.name}: unreadable: {reason(e)}")
                continue
            if not isinstance(data, Mapping) or "schema" not in data:
                continue                    # a trace or some other JSON file
            try:
                found.append((path, Evidence.from_dict(data)))
            except ValueError as e:
                problems.append(f"{path.name}: not valid evidence: {e}")
        found.sort(key=lambda pe: pe[1].created_unix, reverse=True)
        return found, problems

    def problems(self) -> list[str]:
        return self.load()[1]

    def capability(self, name: str, *, device: str, runtime_version: str,
                   calbin_sha256: str | None = None, declared: Capabilities | None = None,
                   max_age_s: float | None = None, now: float | None = None) -> Capability:
        """What the evidence says about capability ``name`` for ``device`` running
        ``runtime_version`` (and ``calbin_sha256``, unless None: any calbin). ``declared``
        (a driver's :class:`Capabilities`) turns a missing proof into ``CLAIMED`` when
        the driver declares the feature; ``max_age_s`` makes older evidence stale."""
        files, problems = self.load()
        return self._answer(capability_info(name), files, problems, device=device,
                            runtime_version=runtime_version, calbin_sha256=calbin_sha256,
                            declared=declared, max_age_s=max_age_s,
                            now=time.time() if now is None else now)

    def capabilities(self, *, device: str, runtime_version: str,
                     calbin_sha256: str | None = None, declared: Capabilities | None = None,
                     max_age_s: float | None = None, now: float | None = None
                     ) -> list[Capability]:
        """:meth:`capability` of every name in :data:`CAPABILITIES`, files read once."""
        files, problems = self.load()
        now = time.time() if now is None else now
        return [self._answer(info, files, problems, device=device,
                             runtime_version=runtime_version,
                             calbin_sha256=calbin_sha256, declared=declared,
                             max_age_s=max_age_s, now=now) for info in CAPABILITIES]

    def _answer(self, info: CapabilityInfo, files: list[tuple[Path, Evidence]],
                problems: list[str], *,
                device: str, runtime_version: str, calbin_sha256: str | None,
                declared: Capabilities | None, max_age_s: float | None, now: float
                ) -> Capability:
        stale: str | None = None
        for path, ev in files:                       # newest first
            verdict = ev.verdicts.get(info.name)
            if verdict is None:
                continue
            age = max(0.0, now - ev.created_unix)
            why = _staleness(ev, age, device=device, runtime_version=runtime_version,
                             calbin_sha256=calbin_sha256, max_age_s=max_age_s)
            if why is not None:
                stale = stale or f"stale: {path.name} ({format_age(age)}) {why}"
                continue
            where = f"{path.name}, {format_age(age)}"
            if verdict.holds and not ev.complete:
                # a runner that could not make every observation proves nothing
                stale = stale or (f"incomplete: {path.name} ({format_age(age)}) could not "
                                  "make every observation")
                continue
            if verdict.holds:
                return Capability(info.name, Level.PROVEN,
                                  f"proven by {where}: {verdict.reason}", path, age, ev)
            return Capability(info.name, Level.FAILED,
                              f"does not hold ({where}): {verdict.reason}", path, age, ev)
        missing = stale or (f"no evidence for {device} runtime {runtime_version} in "
                            f"{self.directory}: run {info.script} on this device")
        if problems:
            # a file that cannot be read might have been the one to decide: say so
            missing += (f"; {len(problems)} unreadable evidence file(s) ignored: "
                        + "; ".join(problems))
        if declared is not None and info.declared is not None and info.declared(declared):
            return Capability(info.name, Level.CLAIMED,
                              f"claimed by the driver's declared capabilities, not "
                              f"proven; {missing}")
        return Capability(info.name, Level.UNKNOWN, missing)


def _staleness(ev: Evidence, age: float, *, device: str, runtime_version: str,
               calbin_sha256: str | None, max_age_s: float | None) -> str | None:
    """Why ``ev`` says nothing about this device, or None when it does."""
    if ev.device != device:
        return f"is for device {ev.device!r}, this is {device!r}"
    if ev.runtime_version != runtime_version:
        return f"is for runtime {ev.runtime_version}, this device runs {runtime_version}"
    if calbin_sha256 is not None and ev.calbin_sha256 != calbin_sha256:
        return (f"is for calbin {ev.calbin_sha256[:12]}..., this one is "
                f"{calbin_sha256[:12]}...")
    if max_age_s is not None and age > max_age_s:
        return f"is older than the {format_age(max_age_s).removesuffix(' ago')} allowed"
    return None
