"""llama.cpp's ``llama_decode`` return codes, derived from calfsm's errors by one table.

llama.cpp documents: 0 success; 1 no KV slot for the batch (retry with a smaller batch or
later; the memory is as before the call); 2 aborted (what was processed stays); -1 an
invalid input batch (the memory is as before the call); below -1 a fatal error (what was
processed stays; ask the memory what it holds). :data:`RETURN_CODES` decides which
:class:`~calfsm.errors.CalfsmError` becomes which code: the first rule that matches the
error's class, category and stage wins. The categories are calfsm's own
(:mod:`calfsm.errors`), so a code means here what the category means to the executor.
Two fatal codes tell apart "this executor cannot serve" (-2: closed, broken, a
configuration, artifact or programming error) from "the device failed the batch" (-3:
the sequence's KV is lost and the sequence must start again at position 0).
"""

from __future__ import annotations

import attrs

from calfsm.errors import (
    CalfsmError,
    Cancelled,
    DeadlineExceeded,
    ErrorCategory,
    ResourceExhausted,
)

__all__ = ["ABORTED", "DEVICE_FAILED", "EXECUTOR_UNUSABLE", "INVALID_INPUT", "NO_KV_SLOT",
           "RETURN_CODES", "SUCCESS", "CodeRule", "render_table", "return_code"]

SUCCESS = 0
#: no KV room, token budget or queue place for the batch in time: nothing ran
NO_KV_SLOT = 1
#: the caller aborted (abort callback or ``abort()``)
ABORTED = 2
#: the batch is wrong for the model or for the sequence
INVALID_INPUT = -1
#: fatal: the executor cannot serve (closed, broken, misconfigured, a calfsm bug)
EXECUTOR_UNUSABLE = -2
#: fatal: the device failed the batch or is being reset; the sequence's KV is lost
DEVICE_FAILED = -3


@attrs.frozen
class CodeRule:
    """One row: errors of class ``error`` (and its subclasses), of one of
    ``categories`` and met at one of ``stages`` (empty: any) get ``code``."""

    code: int
    why: str
    error: type[CalfsmError] = CalfsmError
    categories: frozenset[ErrorCategory] = frozenset()
    stages: frozenset[str] = frozenset()

    def matches(self, err: CalfsmError) -> bool:
        return (isinstance(err, self.error)
                and (not self.categories or err.category in self.categories)
                and (not self.stages or err.stage in self.stages))


_C = ErrorCategory

#: calfsm error -> llama.cpp return code; the first matching row wins
RETURN_CODES: tuple[CodeRule, ...] = (
    CodeRule(ABORTED, "the caller aborted; ubatches already processed stay in the sequence",
             Cancelled),
    CodeRule(NO_KV_SLOT, "KV capacity, token budget or the wait queue is full: nothing ran; "
             "retry with a smaller batch or later", ResourceExhausted),
    CodeRule(DEVICE_FAILED, "the device's Wait passed the execution deadline: the job may "
             "still run and the sequence's KV is unknown", DeadlineExceeded,
             stages=frozenset({"wait"})),
    CodeRule(NO_KV_SLOT, "a transient condition before the device ran the batch (admission "
             "or queue deadline, device busy): retry later",
             categories=frozenset({_C.TRANSIENT})),
    CodeRule(INVALID_INPUT, "the batch does not fit the model or the sequence",
             categories=frozenset({_C.REQUEST})),
    CodeRule(DEVICE_FAILED, "the device failed or is being reset: the sequence's KV is lost",
             categories=frozenset({_C.DEVICE, _C.UNKNOWN})),
    CodeRule(EXECUTOR_UNUSABLE, "the executor cannot serve: closed, broken, or a "
             "configuration, artifact, compatibility or programming error",
             categories=frozenset({_C.LIFECYCLE, _C.ARTIFACT, _C.COMPATIBILITY,
                                   _C.PROGRAMMING})),
)

def return_code(err: CalfsmError) -> int:
    """The llama.cpp return code of ``err`` (never 0)."""
    for rule in RETURN_CODES:
        if rule.matches(err):
            return rule.code
    # the category rows cover every category (tests/llama/test_llama.py checks it)
    raise AssertionError(f"no return-code rule for {err!r}")


def render_table() -> str:
    """:data:`RETURN_CODES` as a Markdown table (``docs/llama.md`` holds it)."""
    lines = ["| llama code | calfsm error | category | stage | meaning |",
             "| --- | --- | --- | --- | --- |"]
    for r in RETURN_CODES:
        cats = ", ".join(sorted(c.value for c in r.categories)) or "any"
        stages = ", ".join(sorted(r.stages)) or "any"
        lines.append(f"| {r.code} | `{r.error.__name__}` | {cats} | {stages} | {r.why} |")
    return "\n".join(lines) + "\n"
