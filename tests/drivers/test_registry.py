"""The one driver registry: built-ins, the ``calfsm.drivers`` entry-point group, lazy
import, and the errors of unknown, clashing and broken registrations."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest

from calfsm.drivers import driver_class, driver_names, load_driver, registry
from calfsm.drivers.calrt import CalrtDriver
from calfsm.drivers.sim import SimDriver
from calfsm.errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[2]


class PluginDriver(SimDriver):
    """A driver another distribution registers."""

    name = "plugin"


def _with_entry_points(monkeypatch: pytest.MonkeyPatch, *eps: tuple[str, str]) -> None:
    fake = [EntryPoint(name, value, registry.GROUP) for name, value in eps]
    monkeypatch.setattr(registry, "entry_points",
                        lambda group: [e for e in fake if e.group == group])


def test_builtin_drivers_by_name() -> None:
    assert driver_names() == sorted(driver_names())
    assert {"sim", "calrt"} <= set(driver_names())
    assert driver_class("sim") is SimDriver
    assert driver_class("calrt") is CalrtDriver
    with load_driver("sim", seed=7) as d:
        assert isinstance(d, SimDriver) and d.seed == 7


@pytest.mark.parametrize("name", ["simm", "", "SIM", 3, None])
def test_unknown_name_lists_the_known_drivers(name) -> None:
    with pytest.raises(InvalidArgument, match=r"driver: unknown driver .*known: calrt, sim"):
        driver_class(name)
    with pytest.raises(InvalidArgument, match="unknown driver"):
        load_driver(name)


def test_pyproject_declares_the_builtins_in_the_group() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
    assert data["project"]["entry-points"][registry.GROUP] == registry.BUILTIN


def test_installed_metadata_lists_the_builtins() -> None:
    eps = {e.name: e.value for e in entry_points(group=registry.GROUP)}
    assert {k: eps.get(k) for k in registry.BUILTIN} == registry.BUILTIN


def test_an_entry_point_adds_a_driver(monkeypatch) -> None:
    _with_entry_points(monkeypatch, ("plugin", f"{__name__}:PluginDriver"),
                       ("sim", registry.BUILTIN["sim"]))      # the same target: no clash
    assert driver_names() == ["calrt", "plugin", "sim"]
    assert driver_class("plugin") is PluginDriver
    assert driver_class("sim") is SimDriver


@pytest.mark.parametrize(("value", "match"), [
    ("no_such_module_xyz:Driver", "does not import"),
    (f"{__name__}:Missing", "does not import"),
    (f"{__name__}:ROOT", "not a class"),
])
def test_a_broken_registration_is_refused(monkeypatch, value, match) -> None:
    _with_entry_points(monkeypatch, ("broken", value))
    with pytest.raises(InvalidArgument, match=match):
        driver_class("broken")
    assert driver_class("sim") is SimDriver                   # the others still work


def test_a_name_registered_twice_is_refused(monkeypatch) -> None:
    _with_entry_points(monkeypatch, ("sim", f"{__name__}:PluginDriver"))
    with pytest.raises(InvalidArgument, match="registered more than once"):
        driver_class("sim")


def test_modules_are_imported_only_when_asked_for(monkeypatch, tmp_path) -> None:
    (tmp_path / "calfsm_probe_driver.py").write_text("class Probe:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _with_entry_points(monkeypatch, ("probe", "calfsm_probe_driver:Probe"))
    assert "probe" in driver_names()
    assert "calfsm_probe_driver" not in sys.modules
    assert driver_class("probe").__module__ == "calfsm_probe_driver"
    monkeypatch.delitem(sys.modules, "calfsm_probe_driver")


def test_the_cffi_driver_is_not_imported_until_asked_for() -> None:
    code = ("import sys; from calfsm.drivers import driver_names, driver_class; "
            "driver_names(); driver_class('sim'); a = 'calfsm.drivers.calrt' in sys.modules; "
            "driver_class('calrt'); print(a, 'calfsm.drivers.calrt' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]
