"""The error tables in docs/architecture.md are exactly what the code gives, and any
change to the code's tables makes them stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from calfsm import errors
from calfsm.errors import (
    ACTIONS,
    CODE_TABLE,
    AdmissionEffect,
    CalrtCode,
    ErrorCategory,
    InvalidArgument,
    JobEffect,
    RecoveryAction,
    ServiceAction,
    Unavailable,
)
from calfsm.tools import errortable

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _row(table: str, first_cell: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(f"| {first_cell} |"))


def test_committed_block_is_current() -> None:
    assert errortable.is_current(DOC), (
        "the error table in docs/architecture.md is stale: run `python -m calfsm.tools.errortable`")
    assert errortable.main(["--check", "--doc", str(DOC)]) == 0


def test_every_category_code_and_error_class_is_in_the_table() -> None:
    table = errortable.render()
    for category in ErrorCategory:
        assert _row(table, category.value)
    for code in CalrtCode:
        if code is not CalrtCode.SUCCESS:
            assert f"{int(code)} `{code.name}`" in table
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, errors.CalfsmError):
            assert _row(table, f"`{name}`")


def test_rows_say_what_the_code_does() -> None:
    table = errortable.render()
    transient = _row(table, "transient")
    assert "13 `TIMEOUT`, 17 `DEVICE_BUSY`" in transient
    assert "`back off`; `requeue` when" in transient
    assert "`drain and reset` once the error budget is spent" in transient
    assert _row(table, "artifact").endswith("| `roll back` |")
    assert _row(table, "compatibility").endswith("| `stop` |")
    assert "any other code" in _row(table, "unknown")
    closed = _row(table, "`ExecutorClosed`")
    assert "| `Unavailable` | programming | 503 | `UNAVAILABLE` | - |" in closed
    assert "| 429 | `RESOURCE_EXHAUSTED` | 1 |" in _row(table, "`ResourceExhausted`")


def test_a_changed_action_row_makes_the_doc_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    # the fault policy reads the same row: its decision column moves with it
    monkeypatch.setitem(ACTIONS, ErrorCategory.PROGRAMMING, ServiceAction(
        JobEffect.FAIL, AdmissionEffect.STOP_NOW, RecoveryAction.QUARANTINE_RESET))
    row = _row(errortable.render(), "programming")
    assert "| stop now | quarantine -> reset/restart/escalate | `drain and reset` |" in row
    assert not errortable.is_current(DOC)
    assert errortable.main(["--check", "--doc", str(DOC)]) == 1


def test_a_reclassified_code_makes_the_doc_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(CODE_TABLE, CalrtCode.DEVICE_BUSY,
                        (ErrorCategory.DEVICE, Unavailable))
    table = errortable.render()
    assert "17 `DEVICE_BUSY`" in _row(table, "device")
    assert "17 `DEVICE_BUSY`" not in _row(table, "transient")
    assert not errortable.is_current(DOC)


def test_write_replaces_only_the_block(tmp_path: Path) -> None:
    doc = tmp_path / "arch.md"
    doc.write_text(f"# intro\n\n{errortable.BEGIN}\n\nold table\n{errortable.END}\n\n"
                   "after\n", "utf-8")
    assert errortable.main(["--check", "--doc", str(doc)]) == 1
    assert errortable.main(["--doc", str(doc)]) == 0
    text = doc.read_text("utf-8")
    assert text.startswith("# intro\n\n") and text.endswith(f"{errortable.END}\n\nafter\n")
    assert "old table" not in text and errortable.render() in text
    assert errortable.main(["--check", "--doc", str(doc)]) == 0
    assert errortable.write(doc) is False


def test_a_document_without_the_markers_is_refused(tmp_path: Path, capsys) -> None:
    doc = tmp_path / "plain.md"
    doc.write_text("# no table here\n", "utf-8")
    with pytest.raises(InvalidArgument, match="has no error-table block"):
        errortable.is_current(doc)
    assert errortable.main(["--check", "--doc", str(doc)]) == 2
    assert "plain.md has no error-table block" in capsys.readouterr().err
    assert doc.read_text("utf-8") == "# no table here\n"
