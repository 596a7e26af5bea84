"""Reading and checking one job's output: the one copy used by the pipeline, the warm-up
golden and the direct path.

A job's output is trusted only after these checks, in this order: the device's status is
``DONE_OK`` (a CCU exception can come with a successful Wait, FI08), ``output_bytes``
succeeded and reports exactly the logits tensor's byte size (FI09), and the logits row is
finite (FI10). Any other size is an output fault of the device, even one that covers
the row a job reads: a job that ends ``DONE_OK`` writes its whole output tensor
(docs/driver-protocol.md), so a device that says it wrote less (or more) broke its own
output contract, and whether the row happened to be covered — which depends only on the
prompt's length — must not decide whether that is noticed (docs/architecture.md,
Errors). :func:`read_output` makes the two device calls (the pipeline makes them under its
device lock, next to ``undo_slice``); :func:`check_output` judges what they returned and
converts the one needed row into the caller's float32 target.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from calfsm.drivers.base import Driver, OutputStatus
from calfsm.engine.logits import extract_logits
from calfsm.errors import CalrtCode, ErrorCategory, Unavailable, from_calrt, output_fault
from calfsm.manifest import SubmodelContract

__all__ = ["OutputReading", "check_ending", "check_job", "check_output", "convert_row",
           "is_row_failure", "read_output", "row_failure", "status_name"]

#: (the job's status, output_bytes code, bytes produced, and on a batch graph row 0's
#: own ending when the job ended DONE_OK, else None)
OutputReading = tuple[int, int, int, int | None]


def read_output(driver: Driver, out: Any, contract: SubmodelContract) -> OutputReading:
    """The device calls that tell how a finished job ended (no judgement yet). A job of a
    batch graph carries its first (or only) row as row 0, which ends on its own
    (``row_status``): read apart from the job's status, so that a row's failure is the
    row's whether or not other rows shared the job."""
    status = driver.status(out)
    row = driver.row_status(out, 0) if contract.batched \
        and status == OutputStatus.DONE_OK else None  # type: ignore[attr-defined]
    code, produced = driver.output_bytes(out, contract.logits.name)
    return status, code, produced, row


def row_failure(status: int, row: int, ctx: dict[str, Any]) -> Unavailable:
    """The error of row ``row`` of a job of a batch graph that ended ``status`` while the
    job ended DONE_OK: the row's own failure (stage ``row``), the same whether the job
    carried one row or several."""
    return Unavailable(f"row {row} of a batch job ended {status_name(status)} although the "
                       "job ended DONE_OK", category=ErrorCategory.DEVICE, stage="row",
                       **ctx)


def is_row_failure(err: Exception) -> bool:
    """Whether ``err`` is a row's own failure (:func:`row_failure`): the job ran well,
    one row of it did not. It fails that row alone: not a fault of the device."""
    return isinstance(err, Unavailable) and err.stage == "row"


def check_ending(reading: OutputReading, ctx: dict[str, Any]) -> None:
    """Raise the classified error of a job that did not end well (status, output code)."""
    status, code = reading[0], reading[1]
    if status != OutputStatus.DONE_OK:
        raise Unavailable(f"device reported {status_name(status)} although Wait "
                          "succeeded", category=ErrorCategory.DEVICE, stage="status", **ctx)
    if code != 0:
        raise from_calrt(code, "output", **ctx)


def check_job(reading: OutputReading, contract: SubmodelContract,
              ctx: dict[str, Any]) -> None:
    """Raise the classified error of a bad ending or of an output of any size but the
    tensor's (an output fault): what fails a job as a whole, every row of a batch."""
    check_ending(reading, ctx)
    produced = reading[2]
    expected = contract.logits.byte_size
    if produced != expected:
        raise output_fault(f"{'short' if produced < expected else 'oversized'} output: "
                           f"device reports {produced} bytes for {contract.logits.name!r}, "
                           f"its byte size is {expected} (a job that ends DONE_OK writes "
                           "the whole tensor)", calrt_code=CalrtCode.SHAPE_MISMATCH,
                           stage="output", **ctx)


def check_output(reading: OutputReading, logits_bf16: np.ndarray,
                 contract: SubmodelContract, token_count: int,
                 target: np.ndarray | None, ctx: dict[str, Any]) -> np.ndarray:
    """Raise the classified error of a bad ending or of an output of any size but the
    tensor's (an output fault); else the float32 logits of the last token, written into
    ``target`` (allocated when None)."""
    check_job(reading, contract, ctx)
    row = reading[3]
    if row is not None and row != OutputStatus.DONE_OK:
        raise row_failure(row, 0, ctx)
    return convert_row(reading, logits_bf16, contract, token_count, target, ctx)


def convert_row(reading: OutputReading, logits_bf16: np.ndarray,
                contract: SubmodelContract, token_count: int,
                target: np.ndarray | None, ctx: dict[str, Any]) -> np.ndarray:
    """:func:`check_output` after :func:`check_job` passed: the float32 logits of the
    last token (bounds and finite values checked), written into ``target`` (allocated
    when None). A batch judges its job once and converts each row with this."""
    produced = reading[2]
    if target is None:
        target = np.empty(contract.vocab, dtype=np.float32)
    return extract_logits(logits_bf16, produced, contract, token_count, target)


def status_name(status: int) -> str:
    """A device status by its name (a value the protocol does not know, by number)."""
    try:
        return OutputStatus(status).name
    except ValueError:
        return f"status {status}"
