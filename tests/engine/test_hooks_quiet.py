"""``Hooks.quiet`` (issue 35, item 4): the pipeline skips a hook's call only when every
hook is the default's no-op, so a driver that overrides any one of them is still told."""

from calfsm.engine.parts import Hooks
from calfsm.runtime.drive import StepRuntime, ThreadRuntime


def test_default_hooks_are_quiet_and_step_mode_keeps_them():
    assert Hooks.quiet and StepRuntime.quiet


def test_overriding_any_hook_makes_a_driver_heard():
    class Told(Hooks):
        def job_parked(self) -> None:
            pass

    assert not Told.quiet and not ThreadRuntime.quiet
