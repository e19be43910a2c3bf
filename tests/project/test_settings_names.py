"""Every ``RATCHET_*`` name is a setting or a known other name; a typo is refused at
start-up, naming the variable and the closest known name, and starts nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet.errors import ConfigurationError
from ratchet.fleet.settings import (
    OTHER_NAMES,
    Settings,
    check_environment_names,
    setting_names,
)
from tests.worker.processes import redis_servers_under

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bRATCHET_[A-Z0-9_]*[A-Z0-9]\b")
# Spelled in two parts so that the scan below does not find it in this file.
TYPO = "RATCHET_" + "REDIS_ULR"


def names_in_repository() -> dict[str, set[str]]:
    """Every RATCHET_* name in the code, tests, CI and compose files, with where it is."""
    files = [ROOT / "docker-compose.yml", ROOT / "Dockerfile"]
    for folder in ("src", "tests", ".ci", "benchmarks"):
        files += [
            p
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and p.suffix not in {".pyc"} and "__pycache__" not in p.parts
        ]
    found: dict[str, set[str]] = {}
    for path in files:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        for name in NAME.findall(text):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_ratchet_name_in_the_repository_is_a_setting_or_a_known_other_name() -> None:
    found = names_in_repository()
    assert "RATCHET_REDIS_URL" in found and "RATCHET_TEST_REDIS_URL" in found  # the scan works
    known = setting_names() | OTHER_NAMES
    unknown = {name: sorted(where) for name, where in found.items() if name not in known}
    assert unknown == {}


def test_settings_and_other_names_do_not_overlap() -> None:
    assert setting_names() & OTHER_NAMES == frozenset()
    assert "RATCHET_WORKER_RESTART_BACKOFF_MS" in setting_names()


def test_an_unknown_name_is_refused_with_the_closest_known_name_and_never_its_value() -> None:
    with pytest.raises(ConfigurationError) as caught:
        check_environment_names({TYPO: "redis://:hunter2@example.invalid/0", "HOME": "/x"})
    assert caught.value.field == TYPO
    assert f"{TYPO} (did you mean RATCHET_REDIS_URL?)" in caught.value.message
    assert "hunter2" not in caught.value.message + repr(caught.value)


def test_every_unknown_name_is_listed_and_one_with_no_close_match_gets_no_guess() -> None:
    far = "RATCHET_" + "ZZZ"
    env = {TYPO: "x", far: "y", "RATCHET_QUEUE": "q"}
    with pytest.raises(ConfigurationError) as caught:
        check_environment_names(env)
    message = caught.value.message
    assert TYPO in message and far in message
    assert f"{far} (did you mean" not in message
    assert "RATCHET_QUEUE " not in message and "RATCHET_QUEUE," not in message


def test_names_are_compared_without_regard_to_case_as_settings_are_read() -> None:
    check_environment_names({"ratchet_redis_url": "redis://x/0", "RATCHET_LOG_LEVEL": "INFO"})
    with pytest.raises(ConfigurationError, match="did you mean RATCHET_REDIS_URL"):
        check_environment_names({TYPO.lower(): "x"})


def test_known_names_and_other_prefixes_pass() -> None:
    env = {name: "1" for name in setting_names() | OTHER_NAMES}
    env.update(RATCHETX_FOO="1", MY_RATCHET_THING="1", PATH="/bin")
    check_environment_names(env)


def test_reading_settings_from_the_environment_refuses_a_typo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TYPO, "redis://127.0.0.1:6379/0")
    with pytest.raises(ConfigurationError, match=TYPO):
        Settings()
    with pytest.raises(ConfigurationError, match=TYPO):
        Settings(queue="explicit")  # explicit values do not skip the check
    monkeypatch.delenv(TYPO)
    assert Settings().embedded


def test_ratchet_runs_with_a_typo_exits_two_naming_it_and_starts_no_server(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("RATCHET_")}
    env.update(
        HOME=str(home),
        RATCHET_STATE_DIR=str(tmp_path / "state"),
        **{TYPO: "redis://127.0.0.1:6379/0"},
    )
    done = subprocess.run(
        [sys.executable, "-m", "ratchet.cli.entry", "runs"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("ratchet: error: unknown environment variable")
    assert f"{TYPO} (did you mean RATCHET_REDIS_URL?)" in lines[0]
    assert done.stdout == ""
    assert not (tmp_path / "state").exists()
    assert redis_servers_under(tmp_path) == []


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"RATCHET_LEASE_TTL_MS": "s3cr3t-not-a-number"}, "RATCHET_LEASE_TTL_MS"),
        ({"RATCHET_LEASE_TTL_MS": "1000", "RATCHET_RENEW_INTERVAL_MS": "5000"}, "renew_interval"),
    ],
)
def test_a_bad_setting_value_is_one_line_naming_it_and_never_its_value(
    tmp_path: Path, variables: dict[str, str], named: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("RATCHET_")}
    env.update(HOME=str(tmp_path), RATCHET_STATE_DIR=str(tmp_path / "state"), **variables)
    done = subprocess.run(
        [sys.executable, "-m", "ratchet.cli.entry", "runs"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("ratchet: error: bad setting") and named in lines[0]
    assert "Traceback" not in done.stderr and "s3cr3t" not in done.stderr
