"""``calfsm serve`` as a user runs it: the one line starts the server on the simulated
device in real time and answers; SIGINT stops it with status 0; a device that cannot
start ends it with status 3 and one line saying why; ``--help`` documents it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx
import pytest

from calfsm import cli
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.errors import CalrtCode
from tests.test_serve import TOK, params_of, poll, reference

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_calfsm_serve_answers_and_stops_on_sigint():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "calfsm.cli", "serve", "--manifest", "tiny", "--port",
         str(port), "--decode-ms", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(url + "/ready", timeout=2).status_code == 200
            except httpx.TransportError:
                assert proc.poll() is None, proc.communicate()
                return False

        poll(ready, 30, "calfsm serve never became ready", every=0.05)
        body = {"model": "tiny", "prompt": "hi", "temperature": 0, "max_tokens": 5}
        r = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert TOK.encode(r.json()["choices"][0]["text"]) == reference(
            TOK.encode("hi"), params_of(body))
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def test_a_device_that_cannot_start_exits_3(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    FaultPlan([FaultRule.always("configure", "code",
                                code=int(CalrtCode.INVALID_CALBIN))]).save(plan)
    rc = cli.main(["serve", "--manifest", "tiny", "--port", str(_free_port()),
                   "--faults", str(plan)])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "start-up failed" in err.splitlines()[-1]


def test_bad_serve_options_exit_2(tmp_path, capsys):
    assert cli.main(["serve", "--manifest", str(tmp_path / "missing.json")]) == 2
    assert "not a built-in manifest" in capsys.readouterr().err
    assert cli.main(["serve", "--decode-ms", "-1"]) == 2
    assert "decode_ms must be a finite number >= 0" in capsys.readouterr().err


def test_serve_help_names_every_option(capsys):
    assert cli.main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--host", "--port", "--driver", "--manifest", "--model-name",
                   "--decode-ms", "--prefill-token-us", "--faults", "--seed",
                   "--max-sequences", "--max-waiting", "--request-timeout", "--hang-after",
                   "--default-max-tokens", "--log-level", "--shutdown-grace"):
        assert option in out, option
