"""Agent-written code never reaches key material: a verifier test written by the agent
hunts for the worker's keys (the environ and command line of every process it can see,
the key file the worker was configured with, every ``RATCHET_*`` variable, any readable
file holding the key) under a real worker, and finds none. The same hunt without the
sandbox finds the key, which is what the sandbox is for."""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

from ratchet.adapters.sandbox import Sandbox, SandboxMode
from ratchet.adapters.verifier import CommandVerifier
from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.demo.examples import make_greeting_workspace
from ratchet.errors import ConfigurationError
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import EnvironmentSpec, RunDocument, VerifierSpec
from ratchet.fleet.settings import Settings
from ratchet.ops import submit
from ratchet.runtime import Scenario
from ratchet.worker.job import execute_run
from tests.conftest import require_sandbox
from tests.worker.fleet_harness import poll, workers

pytestmark = pytest.mark.sandbox

HUNT = r"""
import json, os, time
KEY_FILE = {key_file!r}
loot = {{"pid": os.getpid(), "procs": [], "read": {{}}}}
def grab(where, path, limit=1 << 16):
    try:
        with open(path, "rb") as fh:
            loot["read"][where] = fh.read(limit).decode("latin-1")
    except OSError:
        pass
files = {{KEY_FILE}}
for k, v in os.environ.items():
    loot["read"]["env:" + k] = v
for name in os.listdir("/proc"):
    if name.isdigit():
        loot["procs"].append(int(name))
        for part in ("environ", "cmdline"):
            grab(f"/proc/{{name}}/{{part}}", f"/proc/{{name}}/{{part}}")
        environ = loot["read"].get(f"/proc/{{name}}/environ", "")
        for entry in environ.split("\0"):
            k, _, v = entry.partition("=")
            if k.startswith("RATCHET") and k.endswith("_FILE"):
                files.add(v)
for path in files:
    grab("file:" + path, path)
deadline = time.monotonic() + 5
skip = ("/proc", "/sys", "/dev", "/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin")
for root, dirs, names in os.walk("/"):
    if time.monotonic() > deadline:
        break
    if root.startswith(skip) or "site-packages" in root or "/.git" in root:
        dirs[:] = []
        continue
    for f in names:
        path = os.path.join(root, f)
        try:
            if os.path.getsize(path) <= 16384:
                grab("file:" + path, path)
        except OSError:
            pass
open(os.path.join(os.environ["HOME"], "loot.txt"), "w").write(json.dumps(loot))
"""


LOOT = ".ratchet/verifier-home/loot.txt"  # the verifier's $HOME, on the host


def hunting_document(root: Path, key_file: Path) -> RunDocument:
    """A run whose agent writes ``hunt.py`` (it copies everything it can read that might
    hold a key into ``loot.txt`` in its ``$HOME``, the one folder a verifier may write:
    the workspace is read-only to it) and runs it as the
    verifier. The agent knows where keys usually live, never the key."""
    hunt = HUNT.format(key_file=str(key_file))
    scenario = Scenario.model_validate(
        {
            "schema_version": 1,
            "task_id": "hunt",
            "task_version": "1",
            "policy_id": "p",
            "policy_version": "1",
            "permissions": ["write_file", "run_verifier", "finish"],
            "allowed_paths": ["app.py", "hunt.py", "loot.txt"],
            "allowed_verifier_targets": ["unit"],
            "approval_required": [],
            "budgets": {"proposals": 10, "steps": 10, "wall_clock_seconds": 3600, "cost_units": 0},
            "initial_files": {},
            "verifier": {"target": "unit", "expected_files": {}},
        }
    )
    plan = [
        {"kind": "write_file", "args": {"path": "hunt.py", "content": hunt}},
        {"kind": "run_verifier", "args": {"target": "unit"}},
    ]
    return RunDocument(
        scenario=scenario,
        agent="scripted",
        agent_config={"steps": plan},
        environment=EnvironmentSpec(
            root=str(root.resolve()),
            verifiers={"unit": VerifierSpec(argv=(sys.executable, "hunt.py"))},
        ),
    )


@pytest.fixture
def keyed(settings: Settings, tmp_path: Path) -> tuple[Settings, str, Path]:
    key = secrets.token_hex(32)
    key_file = tmp_path / "secrets" / "checkpoint-keys.json"
    key_file.parent.mkdir()
    key_file.write_text(json.dumps({"signing": "k1", "keys": {"k1": key}, "retired": []}))
    key_file.chmod(0o600)
    return (
        settings.model_copy(update={"checkpoint_key": None, "checkpoint_keys_file": key_file}),
        key,
        key_file,
    )


def hunt_under_a_worker(
    settings: Settings, key: str, key_file: Path, tmp_path: Path
) -> dict[str, object]:
    fleet = Fleet.connect(settings)
    root = make_greeting_workspace(tmp_path / "ws")
    run_id = submit(fleet, hunting_document(root, key_file))
    # The worker's own environment names the key file (as a deployment's would).
    env = {
        "RATCHET_CHECKPOINT_KEYS_FILE": str(key_file),
        "RATCHET_REDIS_URL": settings.redis_url.get_secret_value() if settings.redis_url else "",
    }
    with workers(settings) as pool:
        pool.start(1, env=env)
        poll(
            (root / LOOT).exists,
            deadline_s=90,
            what="the agent's test ran and wrote what it found",
        )
        poll(
            lambda: not fleet.store.read_run(run_id).lease_live, deadline_s=60, what="the job ended"
        )
    loot = json.loads((root / LOOT).read_text())
    assert isinstance(loot, dict)
    return loot


def leaks(loot: dict[str, object], key: str, key_file: Path, root: Path) -> list[str]:
    """Where the key (hex or raw bytes) or the key file's contents turned up in what the
    agent's code read, or in any file of the workspace the agent can read back."""
    found = []
    read = loot["read"]
    assert isinstance(read, dict)
    for where, text in read.items():
        data = str(text).encode("latin-1", "replace")
        if key.encode() in data or bytes.fromhex(key) in data:
            found.append(str(where))
    for path in root.rglob("*"):
        if path.is_file() and path.name != "loot.txt":
            data = path.read_bytes()
            if key.encode() in data or bytes.fromhex(key) in data:
                found.append(str(path))
    return found


def test_an_agent_written_test_finds_no_key_under_the_sandbox(
    keyed: tuple[Settings, str, Path], tmp_path: Path
) -> None:
    require_sandbox()
    settings, key, key_file = keyed
    settings = settings.model_copy(update={"verifier_sandbox": SandboxMode.BWRAP})
    loot = hunt_under_a_worker(settings, key, key_file, tmp_path)
    assert leaks(loot, key, key_file, tmp_path / "ws") == []
    read = loot["read"]
    assert isinstance(read, dict)
    assert not [k for k in read if str(k).startswith("env:RATCHET")]
    assert f"file:{key_file}" not in read  # the key file is not even visible
    procs = loot["procs"]
    assert isinstance(procs, list) and len(procs) <= 3  # its own pid namespace only


def test_without_the_sandbox_the_same_test_finds_the_key(
    keyed: tuple[Settings, str, Path], tmp_path: Path
) -> None:
    """The hunt has teeth: unconfined, it reads the worker's environ, finds the key
    file's path and reads the key (the attack the sandbox stops)."""
    settings, key, key_file = keyed
    settings = settings.model_copy(update={"verifier_sandbox": SandboxMode.NONE})
    loot = hunt_under_a_worker(settings, key, key_file, tmp_path)
    assert f"file:{key_file}" in leaks(loot, key, key_file, tmp_path / "ws")


def test_a_worker_with_no_possible_sandbox_refuses_verifier_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    root = make_greeting_workspace(tmp_path / "ws")
    unavailable = Sandbox.resolve(SandboxMode.AUTO, bwrap=str(tmp_path / "no-bwrap"))
    if unavailable.confined:
        pytest.skip("a bwrap binary was found despite the bogus path")
    assert unavailable.mode is SandboxMode.AUTO and "bwrap" in unavailable.unavailable
    verifier = CommandVerifier({"unit": ["/bin/sh", "-c", f"touch {marker}"]}, sandbox=unavailable)
    with (
        WorkspaceAdapter(root, ["app.py"], verifier=verifier) as adapter,
        pytest.raises(ConfigurationError, match="no sandbox is available"),
    ):
        adapter.verify("unit")
    assert not marker.exists()


def test_a_worker_refuses_the_run_with_an_incident_when_no_sandbox_is_possible(
    settings: Settings, tmp_path: Path
) -> None:
    fleet = Fleet.connect(settings)
    root = make_greeting_workspace(tmp_path / "ws")
    run_id = submit(fleet, hunting_document(root, tmp_path / "nothing"))
    fleet.__dict__["sandbox"] = Sandbox.resolve(SandboxMode.AUTO, bwrap=str(tmp_path / "no-bwrap"))
    if fleet.sandbox.confined:
        pytest.skip("a bwrap binary was found despite the bogus path")
    report = execute_run(fleet, run_id, owner="w-nosandbox")
    assert report.outcome == "restore_refused"
    assert "no sandbox is available" in fleet.store.records.incidents(run_id)[0]["message"]
    assert not (root / "hunt.py").exists() and not (root / LOOT).exists()


def test_an_explicit_bwrap_mode_that_cannot_run_is_a_configuration_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigurationError, match="bwrap cannot run"):
        Sandbox.resolve(SandboxMode.BWRAP, bwrap=str(tmp_path / "no-bwrap"))


def test_the_uid_sandbox_refuses_a_key_file_the_verifier_uid_could_read(
    tmp_path: Path,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the uid sandbox needs a root worker")
    key_file = tmp_path / "keys.json"
    key_file.write_text("{}")
    key_file.chmod(0o644)
    with pytest.raises(ConfigurationError, match="readable by the verifier uid"):
        Sandbox.resolve(SandboxMode.UID, uid=65534, masked=[key_file])
    key_file.chmod(0o600)
    assert Sandbox.resolve(SandboxMode.UID, uid=65534, masked=[key_file]).confined


def test_the_sandbox_setting_is_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RATCHET_VERIFIER_SANDBOX", "none")
    monkeypatch.setenv("RATCHET_VERIFIER_READ_ONLY", "/opt/a, /opt/b")
    settings = Settings(checkpoint_key=SecretStr("ab" * 32))
    assert settings.verifier_sandbox is SandboxMode.NONE
    assert settings.verifier_read_only == (Path("/opt/a"), Path("/opt/b"))


def test_a_virtualenv_under_tmp_stays_visible_inside_the_sandbox(tmp_path: Path) -> None:
    """The sandbox's fresh /tmp is mounted before the command's prefix and the workspace
    are bound, so an interpreter that lives under /tmp (a CI checkout) still runs."""
    require_sandbox()
    import subprocess
    import venv

    assert str(tmp_path).startswith("/tmp/")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    root = make_greeting_workspace(tmp_path / "ws")
    verifier = CommandVerifier(
        {"unit": [str(python), "-c", "print('inside')"]}, sandbox=Sandbox.resolve(SandboxMode.BWRAP)
    )
    with WorkspaceAdapter(root, ["app.py"], verifier=verifier) as adapter:
        report = adapter.verify("unit")
    assert report.passed, verifier.last_run
    assert subprocess.run([str(python), "-c", "pass"], check=False).returncode == 0


UID_PROBE = r"""
import sys
from ratchet.adapters.sandbox import Sandbox, SandboxMode
from ratchet.adapters.verifier import CommandVerifier
from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.errors import ConfigurationError
verifier = CommandVerifier({"unit": ["/bin/sh", "-c", "exit 0"]},
                           sandbox=Sandbox.resolve(SandboxMode.UID, uid=65534))
with WorkspaceAdapter(sys.argv[1], ["app.py"], git=False, verifier=verifier) as ws:
    try:
        print("passed" if ws.verify("unit").passed else "failed")
    except ConfigurationError as exc:
        print("refused", exc.context.get("path"))
"""


def test_the_uid_sandbox_refuses_a_workspace_the_verifier_uid_could_write(
    tmp_path: Path,
) -> None:
    """The code the verifier's uid runs could rewrite its own test in a workspace that
    uid can write: such a workspace is refused before the command runs, naming the path."""
    if os.geteuid() != 0:
        pytest.skip("the uid sandbox needs a root worker")
    import subprocess

    tmp_path.chmod(0o755)
    root = make_greeting_workspace(tmp_path / "ws")
    root.chmod(0o755)

    def probe() -> str:
        done = subprocess.run(
            [sys.executable, "-c", UID_PROBE, str(root)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout.strip()

    (root / "test_app.py").chmod(0o666)
    assert probe() == "refused test_app.py"
    (root / "test_app.py").chmod(0o644)
    os.chown(root / "app.py", 65534, 65534)
    assert probe() == "refused app.py"
    os.chown(root / "app.py", 0, 0)
    (root / "tests-dir").mkdir(mode=0o777)
    (root / "tests-dir").chmod(0o777)
    assert probe() == "refused tests-dir"
    (root / "tests-dir").chmod(0o755)
    assert probe() == "passed"
