"""FaultPlan / FaultRule: validation, JSON round trip, load errors, swarm generation."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from calfsm.drivers.faults import (
    DEFAULT_CODES,
    EFFECTS,
    FAULT_POINTS,
    FILTERS,
    POINTS,
    SWARM_KINDS,
    FaultPlan,
    FaultRule,
)
from calfsm.errors import InvalidArgument


def _filter(point: str, field: str, values):
    return values if field in FILTERS[point] else st.none()


rules = st.sampled_from(POINTS).flatmap(lambda p: st.builds(
    FaultRule, st.just(p), st.sampled_from(EFFECTS[p]),
    nth=st.integers(1, 50), every=st.none() | st.integers(1, 10),
    count=st.none() | st.integers(1, 5),
    seq_id=_filter(p, "seq_id", st.none() | st.integers(0, 9)),
    job_id=_filter(p, "job_id", st.none() | st.integers(0, 9)),
    name=_filter(p, "name", st.none() | st.sampled_from(["cur_seq", "x"])),
    code=st.none() | st.integers(1, 40), n_bytes=st.none() | st.integers(0, 1000),
    index=st.integers(0, 100)))


@given(st.lists(rules, max_size=6), st.text(max_size=8))
def test_json_round_trip(rs, name) -> None:
    plan = FaultPlan(tuple(rs), name)
    assert FaultPlan.from_json(plan.to_json()) == plan


def test_save_load(tmp_path) -> None:
    plan = FaultPlan.of(FaultRule("infer", "code", nth=3, code=18),
                        FaultRule.always("kv_can_allocate", "refuse"),
                        FaultRule("infer", "hang", seq_id=4), name="mine")
    assert FaultPlan.load(plan.save(tmp_path / "p.json")) == plan
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["rules"][0] == {"point": "infer", "effect": "code", "nth": 3, "code": 18}


def test_none_is_empty() -> None:
    assert not FaultPlan.none()
    assert FaultPlan.none().rules == ()
    assert FaultPlan.none().describe() == "no faults"


@pytest.mark.parametrize(("text", "where"), [
    ("{not json", "does not parse"),
    ('{"rules": [{"point": "infer", "effect": "code"}, {"point": "nope", "effect": "code"}]}',
     "rules[1].point"),
    ('{"rules": [{"point": "infer", "effect": "explode"}]}', "rules[0].effect"),
    ('{"rules": [{"point": "wait", "effect": "hang"}]}', "rules[0].effect"),
    ('{"rules": [{"point": "infer", "effect": "code", "nth": 0}]}', "rules[0].nth"),
    ('{"rules": [{"point": "infer", "effect": "code", "every": "2"}]}', "rules[0].every"),
    ('{"rules": [{"point": "infer", "effect": "code", "colour": 1}]}', "rules[0].colour"),
    ('{"rules": [{"effect": "code"}]}', "rules[0].point"),
    ('{"rules": [3]}', "rules[0]"),
    ('{"rules": [{"point": "reset", "effect": "code", "seq_id": 1}]}', "rules[0].seq_id"),
    ('{"rules": {}}', "rules"),
    ('{"rulez": []}', "rulez"),
])
def test_load_errors_name_entry_and_field(tmp_path, text, where) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InvalidArgument) as info:
        FaultPlan.load(path)
    assert where in str(info.value)


def test_missing_file() -> None:
    with pytest.raises(InvalidArgument):
        FaultPlan.load("/nonexistent/plan.json")


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000,
                                  '{"rules": [' + "[" * 5000 + "]" * 5000 + "]}"])
def test_deep_json_is_invalid_argument_not_recursion_error(tmp_path, text) -> None:
    path = tmp_path / "deep.json"
    path.write_text(text)
    with pytest.raises(InvalidArgument, match="fault plan does not parse: nested"):
        FaultPlan.load(path)
    with pytest.raises(InvalidArgument, match="more than the 64 allowed"):
        FaultPlan.from_json(text)


def test_a_plan_that_is_no_regular_file_is_refused_at_once(tmp_path) -> None:
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)                     # reading it would block until a writer came
    with pytest.raises(InvalidArgument, match="a FIFO, not a regular file"):
        FaultPlan.load(fifo)
    with pytest.raises(InvalidArgument, match="a directory, not a regular file"):
        FaultPlan.load(tmp_path)


def test_default_codes_cover_code_points() -> None:
    for point, effects in EFFECTS.items():
        if "code" in effects:
            assert FaultRule(point, "code").effective_code == DEFAULT_CODES[point]


def test_fires_at() -> None:
    once = FaultRule("infer", "hang", nth=3)
    assert [once.fires_at(k, 0) for k in range(1, 6)] == [False, False, True, False, False]
    periodic = FaultRule("infer", "hang", nth=2, every=3)
    assert [k for k in range(1, 12) if periodic.fires_at(k, 0)] == [2, 5, 8, 11]
    capped = FaultRule("infer", "hang", nth=1, every=1, count=2)
    assert capped.fires_at(1, 0) and capped.fires_at(2, 1) and not capped.fires_at(3, 2)
    always = FaultRule.always("kv_apply", "refuse")
    assert all(always.fires_at(k, k - 1) for k in range(1, 100))


def test_swarm_deterministic_and_varied() -> None:
    assert FaultPlan.swarm(11) == FaultPlan.swarm(11)
    plans = [FaultPlan.swarm(s) for s in range(200)]
    assert len(set(plans)) > 170
    empty = sum(1 for p in plans if not p.rules)
    assert 5 <= empty <= 60
    effects = {(r.point, r.effect) for p in plans for r in p.rules}
    for pair in [("set_csr", "code"), ("infer", "code"), ("wait", "code"), ("reset", "code"),
                 ("kv_can_allocate", "refuse"), ("kv_apply", "refuse")]:
        assert pair in effects
    for eff in ("ccu_exception", "short_output", "nan", "inf", "hang", "stale"):
        assert ("infer", eff) in effects
    for p in plans:
        assert FaultPlan.from_json(p.to_json()) == p


def test_swarm_kinds_and_rates() -> None:
    p = FaultPlan.swarm(4, kinds=["hang"], p_none=0.0)
    assert [r.effect for r in p.rules] == ["hang"]
    always = FaultPlan.swarm(1, kinds=["kv_can_allocate_always_false"], p_none=0.0)
    assert always.rules == (FaultRule.always("kv_can_allocate", "refuse"),)
    dense = FaultPlan.swarm(2, kinds=["nan"], rate=1.0, p_none=0.0)
    assert dense.rules[0].every == 1 or dense.rules[0].every <= 2
    assert "kv_can_allocate_always_false" not in SWARM_KINDS
    with pytest.raises(InvalidArgument):
        FaultPlan.swarm(1, kinds=["bogus"])
    with pytest.raises(InvalidArgument):
        FaultPlan.swarm(1, kinds=["nan"], rates={"nan": 0.0}, p_none=0.0)


def test_rule_validation_errors() -> None:
    with pytest.raises(InvalidArgument, match="point"):
        FaultRule("nowhere", "code")
    with pytest.raises(InvalidArgument, match="effect"):
        FaultRule("kv_apply", "code")
    with pytest.raises(InvalidArgument, match="count"):
        FaultRule("infer", "code", count=0)
    # a filter the point cannot match is refused, never a rule that silently never fires
    with pytest.raises(InvalidArgument, match="job_id"):
        FaultRule("set_csr", "code", job_id=1)
    with pytest.raises(InvalidArgument, match="seq_id"):
        FaultRule("kv_can_allocate", "refuse", seq_id=1)
    with pytest.raises(InvalidArgument, match="name"):
        FaultRule("infer", "hang", name="x")


@pytest.mark.parametrize(("field", "value"), [
    ("code", 2**31), ("code", -(2**31) - 1), ("code", 0), ("code", True), ("code", 1.0),
    ("code", "13"),
    ("nth", 2**63), ("nth", 0), ("nth", None), ("nth", False),
    ("every", 2**63), ("count", 2**63),
    ("seq_id", 2**31), ("seq_id", -1), ("seq_id", True),
    ("job_id", 2**63), ("job_id", -(2**63) - 1),
    ("n_bytes", 2**63), ("n_bytes", -1),
    ("index", 2**63), ("index", -1), ("index", None),
    ("name", "x" * 256), ("name", "é" * 128), ("name", "a\0b"), ("name", b"cur_seq"),
])
def test_a_field_out_of_its_c_range_is_refused_naming_it(field, value) -> None:
    point = {"seq_id": "infer", "job_id": "infer", "name": "set_csr",
             "n_bytes": "infer", "index": "infer"}.get(field, "set_csr")
    effect = {"n_bytes": "short_output", "index": "nan"}.get(field, "code")
    with pytest.raises(InvalidArgument) as info:
        FaultRule(point, effect, **{field: value})
    assert info.value.message.startswith(f"{field}: must ")
    with pytest.raises(InvalidArgument) as info:
        FaultPlan.from_dict({"rules": [{"point": point, "effect": effect, field: value}]})
    assert info.value.message.startswith(f"rules[0].{field}: must ")


@pytest.mark.parametrize(("field", "value"), [
    ("code", 2**31 - 1), ("code", -(2**31)), ("nth", 2**63 - 1), ("seq_id", 2**31 - 1),
    ("job_id", -(2**63)), ("job_id", 2**63 - 1), ("name", "x" * 255), ("name", "é" * 127),
])
def test_a_field_at_the_edge_of_its_c_range_is_accepted(field, value) -> None:
    point = {"seq_id": "infer", "job_id": "infer"}.get(field, "set_csr")
    rule = FaultRule(point, "code", **{field: value})
    assert getattr(rule, field) == value
    assert FaultPlan.from_json(FaultPlan.of(rule).to_json()).rules == (rule,)


def test_fault_points_tables_agree() -> None:
    assert tuple(p.name for p in FAULT_POINTS) == POINTS
    for p in FAULT_POINTS:
        assert p.fail_effect in ("code", "refuse")
        assert (p.default_code is None) == (p.fail_effect == "refuse")
        assert FILTERS[p.name] == p.filters and EFFECTS[p.name] == p.effects


def test_the_protocol_page_lists_every_fault_point_as_the_code_does() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "driver-protocol.md").read_text()
    rows = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`") and cells[0] != "`point`":
            rows[cells[0].strip("`")] = cells
    assert list(rows) == list(POINTS)
    for p in FAULT_POINTS:
        _, calls, effects, filters, default = rows[p.name]
        assert re.findall(r"`(\w+)`", calls) == list(p.calls)
        assert set(re.findall(r"\b(seq_id|job_id|name)\b", filters)) == p.filters
        code = re.search(r"\((\d+)\)", default)
        assert (int(code.group(1)) if code else None) == p.default_code
        assert effects.split(",")[0].split()[0] == p.fail_effect
