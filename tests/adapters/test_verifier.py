"""The command verifier: allow-listed targets, clean environment, limits, binding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ratchet.adapters import CommandVerifier, VerifierCommand, WorkspaceAdapter
from ratchet.adapters.sandbox import Sandbox, SandboxMode
from ratchet.errors import AdapterError, ConfigurationError
from tests.adapters.harness import PYTEST_CHECK, make_workspace
from tests.conftest import require_sandbox, test_sandbox_mode

pytestmark = pytest.mark.sandbox


def workspace(root: Path, **commands: VerifierCommand | list[str]) -> WorkspaceAdapter:
    make_workspace(root)
    return WorkspaceAdapter(
        root,
        ["app.py", "tests"],
        verifier=CommandVerifier(commands, sandbox=Sandbox.resolve(test_sandbox_mode())),
    )


def py(code: str, **options: object) -> VerifierCommand:
    return VerifierCommand(argv=(sys.executable, "-c", code), **options)  # type: ignore[arg-type]


def test_a_passing_command_reports_passed_bound_to_the_observed_state(tmp_path: Path) -> None:
    with workspace(tmp_path / "ws", ok=py("pass"), bad=py("raise SystemExit(3)")) as ws:
        observed = ws.observe()
        report = ws.verify("ok")
        assert report.passed
        assert (report.env_instance_id, report.env_version, report.env_fingerprint) == (
            observed.instance_id,
            observed.version,
            observed.fingerprint,
        )
        assert not ws.verify("bad").passed


def test_pytest_runs_as_a_verifier_in_the_workspace(tmp_path: Path) -> None:
    with workspace(tmp_path / "ws", unit=PYTEST_CHECK) as ws:
        report = ws.verify("unit")
        assert not report.passed  # the greeting is still misspelt
        verifier = ws._verifier
        assert verifier is not None and verifier.last_run is not None
        assert "1 failed" in verifier.last_run.output


def test_an_unknown_target_is_refused(tmp_path: Path) -> None:
    with workspace(tmp_path / "ws", ok=py("pass")) as ws, pytest.raises(AdapterError) as caught:
        ws.verify("rm-rf")
    assert caught.value.retryable is False


def test_the_command_sees_a_clean_environment_without_inherited_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RATCHET_TEST_API_TOKEN", "s3cr3t-canary")
    code = "import os; print(sorted(os.environ.items()))"
    with workspace(tmp_path / "ws", env=py(code, env={"CI": "1"})) as ws:
        ws.verify("env")
        run = ws._verifier.last_run  # type: ignore[union-attr]
        assert run is not None and run.passed
        assert "s3cr3t-canary" not in run.output and "RATCHET_TEST_API_TOKEN" not in run.output
        assert "('CI', '1')" in run.output
        assert str(ws.state_dir) in run.output  # HOME and TMPDIR live in the state folder


def test_output_beyond_the_limit_is_cut_and_flagged(tmp_path: Path) -> None:
    noisy = py("import sys; sys.stdout.write('x' * 200000)", max_output_bytes=1000)
    with workspace(tmp_path / "ws", noisy=noisy) as ws:
        assert ws.verify("noisy").passed
        run = ws._verifier.last_run  # type: ignore[union-attr]
        assert run is not None and run.truncated and len(run.output) == 1000


def test_a_command_past_its_timeout_is_killed_and_fails(tmp_path: Path) -> None:
    slow = py("import time; time.sleep(120)", timeout_seconds=0.5)
    with workspace(tmp_path / "ws", slow=slow) as ws:
        report = ws.verify("slow")
        run = ws._verifier.last_run  # type: ignore[union-attr]
        assert not report.passed and run is not None and run.timed_out
        assert run.exit_code is None


def test_a_workspace_that_changed_during_the_run_fails_closed(tmp_path: Path) -> None:
    """Unconfined (the explicit opt-out) a command can change the workspace; the report
    is then bound to no state and fails closed whatever the exit code."""
    sneaky = py("open('app.py', 'w').write('changed\\n')")
    make_workspace(tmp_path / "ws")
    verifier = CommandVerifier({"sneaky": sneaky}, sandbox=Sandbox.resolve(SandboxMode.NONE))
    with WorkspaceAdapter(tmp_path / "ws", ["app.py", "tests"], verifier=verifier) as ws:
        before = ws.observe()
        report = ws.verify("sneaky")
        run = verifier.last_run
        assert not report.passed and run is not None and not run.bound and run.exit_code == 0
        assert report.env_version == before.version


def test_under_bubblewrap_the_workspace_is_read_only_to_the_command(tmp_path: Path) -> None:
    require_sandbox()
    sneaky = py("open('app.py', 'w').write('changed\\n')")
    make_workspace(tmp_path / "ws")
    verifier = CommandVerifier({"sneaky": sneaky}, sandbox=Sandbox.resolve(SandboxMode.BWRAP))
    with WorkspaceAdapter(tmp_path / "ws", ["app.py", "tests"], verifier=verifier) as ws:
        before = ws.observe()
        report = ws.verify("sneaky")
        run = verifier.last_run
        assert not report.passed and run is not None and run.bound and run.exit_code != 0
        assert "Read-only file system" in run.output
        assert ws.observe() == before


def test_a_workspace_without_a_verifier_refuses_to_verify(tmp_path: Path) -> None:
    make_workspace(tmp_path / "ws")
    with WorkspaceAdapter(tmp_path / "ws", ["app.py"]) as ws, pytest.raises(AdapterError):
        ws.verify("unit")


def test_bad_verifier_configuration_is_refused() -> None:
    with pytest.raises(ConfigurationError):
        CommandVerifier({"empty": []})
    with pytest.raises(ConfigurationError):
        CommandVerifier({"t": VerifierCommand(argv=("true",), cwd="../up")})
    with pytest.raises(ConfigurationError):
        CommandVerifier({"t": VerifierCommand(argv=("true",), timeout_seconds=0)})
