"""``calfsm serve`` as a user runs it: the one line starts the server on the simulated
device in real time, says where it listens and answers; SIGINT stops it with status 0; a
device that cannot start ends it with status 3 and one line saying why; every bad option
is status 2 with one line naming it; keys come from the options or the environment;
``--help`` documents every option."""

from __future__ import annotations

import argparse
import logging
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.errors import CalrtCode
from calfsm.generate.promptcache import PromptCacheConfig
from calfsm.serve import cli as serve_cli
from calfsm.tools import cli
from tests.helpers.serve import START_S, TOK, Serving, params_of, poll, reference
from tests.helpers.serve_load import free_port

pytestmark = pytest.mark.timeout(180)
#: a client's read timeout here only guards against a hang: these tests promise what the
#: server answers, not how soon a loaded machine schedules it (a /ready that waited 2 s
#: was a ReadTimeout at load 12). How fast probes are is test_serve_probes' to judge.
HANG_S = 20.0


def _ready(url: str) -> bool:
    """``/ready`` answered 200; an answer slower than 2 s (a loaded machine) is a "not
    yet" for the poll to retry within its deadline, not the test's failure."""
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.TimeoutException:
        return False


def test_calfsm_serve_says_where_it_listens_answers_and_stops_on_sigint():
    srv = Serving()
    try:
        poll(lambda: _ready(srv.url), START_S, "calfsm serve never became ready", every=0.05)
        body = {"model": "tiny", "prompt": "hi", "temperature": 0, "max_tokens": 5}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=HANG_S)
        assert TOK.encode(r.json()["choices"][0]["text"]) == reference(
            TOK.encode("hi"), params_of(body))
    finally:
        err = srv.stop()
    assert "warning" not in err.lower(), err       # 127.0.0.1: nobody else can reach it


def test_calfsm_serve_takes_its_keys_from_the_environment():
    srv = Serving(env={"CALFSM_API_KEY": " k-one , k-two "})
    try:
        poll(lambda: _ready(srv.url), START_S, "calfsm serve never became ready", every=0.05)
        body = {"model": "tiny", "prompt": [1], "max_tokens": 2}
        assert httpx.post(srv.url + "/v1/completions", json=body,
                          timeout=HANG_S).status_code == 401
        for key in ("k-one", "k-two"):
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=HANG_S,
                           headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
    finally:
        srv.stop()


def test_an_apps_start_up_loads_the_heavy_import_before_it_serves():
    """The device buffers' bfloat16 (ml_dtypes) is imported by the app's lifespan
    start-up, before uvicorn listens, not by the thread that builds the executor
    meanwhile: that extension's import holds the GIL throughout (~0.6 s of CPU, 4-5 s
    seen at load 10), so every ``/ready`` and ``/health`` during start-up waited that
    long (a 2 s probe timed out). A fresh interpreter, so nothing imported it before."""
    code = """if True:
        import asyncio, sys
        from calfsm.serve import create_app, realtime_sim
        from calfsm.executor import DeviceExecutor
        from tests.helpers.serve import TINY
        async def build():
            return await DeviceExecutor.create(realtime_sim(TINY, decode_ms=0), TINY)
        app = create_app(build)
        async def main():
            assert "ml_dtypes" not in sys.modules
            async with app.router.lifespan_context(app):
                print("ml_dtypes" in sys.modules, flush=True)   # what a probe would find
        asyncio.run(main())
    """
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"], out


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_options_reach_the_executor_the_app_and_the_connections(monkeypatch):
    monkeypatch.setenv("CALFSM_API_KEY", "from-env")
    exconfig, config, limits = serve_cli.configs(_parse(
        "--evidence-dir", "/some/evidence", "--max-sequences", "10", "--max-tokens-cap", "99",
        "--max-client-streams", "3", "--max-client-waiting", "4", "--header-timeout", "2.5",
        "--body-timeout", "7", "--keep-alive", "90", "--max-header-bytes", "8000",
        "--max-connections", "77"))
    assert exconfig.evidence_dir == "/some/evidence"
    assert (exconfig.max_sequences, exconfig.max_waiting) == (10, 20)
    assert (config.max_tokens_cap, config.max_client_streams, config.max_client_waiting) \
        == (99, 3, 4)
    assert config.api_keys == ("from-env",)
    assert (limits.header_timeout_s, limits.body_timeout_s, limits.keep_alive_s,
            limits.max_header_bytes, limits.max_connections) == (2.5, 7, 90, 8000, 77)
    assert exconfig.prompt_cache == PromptCacheConfig(5, 5 * 4096)   # half the ids
    exconfig, config, _ = serve_cli.configs(_parse("--api-key", "a", "--api-key", "b"))
    assert config.api_keys == ("a", "b")           # the options win over the variable
    assert exconfig.evidence_dir is None and exconfig.max_waiting == 128
    assert exconfig.prompt_cache == PromptCacheConfig(32, 32 * 4096)


@pytest.mark.parametrize(("argv", "cache"), [
    (["--prompt-cache", "3,1000"], PromptCacheConfig(3, 1000)),
    (["--prompt-cache", "2"], PromptCacheConfig(2, 2 * 4096)),
    (["--prompt-cache", "1", "--max-sequences", "1"], PromptCacheConfig(1, 4096)),
    (["--max-sequences", "1"], PromptCacheConfig(1, 4096)),
    (["--no-prompt-cache"], None),
])
def test_the_prompt_cache_option_reaches_the_executor(argv, cache):
    exconfig, _, _ = serve_cli.configs(_parse(*argv))
    assert exconfig.prompt_cache == cache


def test_a_reachable_address_without_a_key_warns_once(capsys, caplog):
    with socket.socket() as unbound:     # getsockname 0.0.0.0: what --host 0.0.0.0 binds
        with caplog.at_level(logging.WARNING, logger="calfsm.serve"):
            said = serve_cli.warn_if_open(unbound, ())
        assert said and "no API key" in said and "--api-key" in said
        assert [r.getMessage() for r in caplog.records] == [said]
        assert serve_cli.warn_if_open(unbound, ("k",)) is None
        logger = logging.getLogger("calfsm.serve")
        level = logger.level
        logger.setLevel(logging.ERROR)   # --log-level error: the warning still shows
        try:
            capsys.readouterr()
            assert serve_cli.warn_if_open(unbound, ())
            assert capsys.readouterr().err.count("\n") == 1
        finally:
            logger.setLevel(level)
    with socket.socket() as local:
        local.bind(("127.0.0.1", 0))
        assert serve_cli.warn_if_open(local, ()) is None


def test_a_device_that_cannot_start_exits_3(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    FaultPlan([FaultRule.always("configure", "code",
                                code=int(CalrtCode.INVALID_CALBIN))]).save(plan)
    rc = cli.main(["serve", "--manifest", "tiny", "--port", str(free_port()),
                   "--faults", str(plan)])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "start-up failed" in err.splitlines()[-1]


def test_bad_serve_options_exit_2(tmp_path, capsys):
    assert cli.main(["serve", "--manifest", str(tmp_path / "missing.json")]) == 2
    assert "not a built-in manifest" in capsys.readouterr().err
    assert cli.main(["serve", "--decode-ms", "-1"]) == 2
    assert "decode_ms must be a finite number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "names"), [
    (["--port", "99999"], "--port"), (["--port", "-1"], "--port"), (["--port", "x"], "--port"),
    (["--host", "bad host"], "--host"), (["--host", "999.1.1.1"], "--host"),
    (["--host", "-x-"], "--host"),
    (["--host", "192.0.2.1"], "--host 192.0.2.1"),      # not an address of this machine
    (["--max-sequences", "0"], "--max-sequences"), (["--max-waiting", "0"], "--max-waiting"),
    (["--max-client-streams", "0"], "--max-client-streams"),
    (["--max-client-waiting", "-2"], "--max-client-waiting"),
    (["--max-tokens-cap", "0"], "--max-tokens-cap"),
    (["--default-max-tokens", "100", "--max-tokens-cap", "10"], "--default-max-tokens"),
    (["--header-timeout", "0"], "--header-timeout"), (["--body-timeout", "nan"],
                                                      "--body-timeout"),
    (["--keep-alive", "-5"], "--keep-alive"), (["--request-timeout", "inf"],
                                               "--request-timeout"),
    (["--hang-after", "0"], "--hang-after"), (["--max-header-bytes", "0"],
                                              "--max-header-bytes"),
    (["--max-connections", "0"], "--max-connections"),
    (["--api-key", ""], "--api-key"), (["--api-key", "has space"], "--api-key"),
    (["--prompt-cache", "0"], "--prompt-cache"), (["--prompt-cache", "2,x"],
                                                  "--prompt-cache"),
    (["--prompt-cache", "1,2,3"], "--prompt-cache"),
    (["--prompt-cache", "65"], "--prompt-cache 65"),     # over --max-sequences 64
    (["--prompt-cache", "2", "--no-prompt-cache"], "--no-prompt-cache"),
])
def test_every_bad_option_is_exit_2_with_one_line_naming_it(capsys, argv, names):
    assert cli.main(["serve", "--manifest", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("calfsm: error: "), err
    assert names in err and "Traceback" not in err
    if argv[0] == "--max-sequences":
        assert "max_waiting" not in err


def test_an_address_in_use_is_exit_2(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--manifest", "tiny", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot listen" in err and str(port) in err, err


def test_a_bad_key_in_the_environment_is_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("CALFSM_API_KEY", "good,bad key")
    assert cli.main(["serve", "--manifest", "tiny", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CALFSM_API_KEY" in err and "bad key" not in err


def test_serve_help_names_every_option(capsys):
    assert cli.main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--host", "--port", "--api-key", "--driver", "--manifest", "--evidence-dir",
                   "--model-name", "--decode-ms", "--prefill-token-us", "--faults", "--seed",
                   "--max-sequences", "--max-waiting", "--max-client-streams",
                   "--max-client-waiting", "--request-timeout", "--hang-after",
                   "--default-max-tokens", "--max-tokens-cap", "--header-timeout",
                   "--body-timeout", "--keep-alive", "--max-header-bytes",
                   "--max-connections", "--log-level", "--shutdown-grace",
                   "--prompt-cache", "--no-prompt-cache"):
        assert option in out, option
    assert "0.0.0.0" not in out
    assert "--api-key" in " ".join(out.split("--host HOST", 1)[-1].split()[:40])


def test_no_doc_shows_a_public_host_without_a_key():
    """Wherever --host 0.0.0.0 is shown, the key is in the same command."""
    root = Path(__file__).resolve().parents[2]
    for path in [root / "README.md", *root.glob("docs/*.md"), *root.glob("examples/**/*")]:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for i, line in enumerate(text.splitlines()):
            if re.search(r"--host[ =\"',]+0\.0\.0\.0", line):
                near = "\n".join(text.splitlines()[max(0, i - 3):i + 4])
                assert "api-key" in near or "CALFSM_API_KEY" in near, f"{path}:{i + 1}"
