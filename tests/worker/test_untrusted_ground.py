"""The environment is untrusted ground, under real worker processes.

* The code a verifier runs (the agent wrote it) plants a program in every configuration
  source of the workspace's repository: no worker job, and no operator command, ever
  runs one of them, nor any ``git`` at all (a ``git`` first on the worker's PATH records
  every call). Under the explicit opt-out (no sandbox) the plant lands on disk, which
  proves it has teeth.
* Under bubblewrap the workspace is read-only to that code: it can change neither
  ``.git``, nor its own test, nor a module beside it, and a run whose agent tried to
  rewrite its test to pass does not reach ``completed``.
* A path that is not a regular file (a FIFO, a socket, a device) where an allowed file
  should be stops the run with a typed incident naming it, at once: the worker is not
  blocked and takes the next run.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import threading
from pathlib import Path

import pytest

from ratchet.adapters.sandbox import SandboxMode
from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.demo.examples import RIGHT_GREETING, WRONG_GREETING, make_greeting_workspace
from ratchet.errors import UntrustedGroundError
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import EnvironmentSpec, RunDocument, VerifierSpec
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run, submit
from ratchet.runtime import Action, Scenario
from tests.adapters.harness import run_git
from tests.conftest import require_sandbox
from tests.worker.fleet_harness import poll, workers

pytestmark = pytest.mark.sandbox

# Run by the verifier (it is app.py, which the test runs): plant a program in every
# configuration source of the repository, try to rewrite the test and shadow a module,
# and record what worked in $HOME (the one folder the verifier may write).
TAMPER = r"""
import json, os, pathlib
root = pathlib.Path(__file__).resolve().parent
markers = {markers!r}
results = {{}}
def attempt(name, fn):
    try:
        fn()
        results[name] = "done"
    except OSError as exc:
        results[name] = type(exc).__name__
def script():
    path = pathlib.Path(os.environ["HOME"]) / "evil.sh"
    path.write_text("#!/bin/sh\necho ran >> " + markers + "/planted\n")
    path.chmod(0o755)
    return str(path)
program = script()
config = (
    "[core]\n\tfsmonitor = " + program + "\n\thooksPath = " + os.environ["HOME"] + "\n"
    "\tpager = " + program + "\n\tsshCommand = " + program + "\n"
    "[filter \"evil\"]\n\tclean = " + program + "\n\tsmudge = " + program + "\n"
    "[diff \"evil\"]\n\ttextconv = " + program + "\n"
    "[alias]\n\tstatus = !" + program + "\n"
)
attempt("git_config", lambda: open(root / ".git" / "config", "a").write(config))
attempt("attributes", lambda: (root / ".gitattributes").write_text("* filter=evil diff=evil\n"))
attempt("hook", lambda: (root / ".git" / "hooks" / "post-index-change").write_text("#!/bin/sh\n"))
attempt("test_rewrite", lambda: (root / "test_app.py").write_text("print('Hello, world')\n"))
attempt("shadow", lambda: (root / "subprocess.py").write_text("raise SystemExit(0)\n"))
pathlib.Path(os.environ["HOME"], "tamper.json").write_text(json.dumps(results))
"""


def tamper_document(root: Path, markers: Path, *, greeting: str) -> RunDocument:
    app = TAMPER.format(markers=str(markers)) + f"\nprint({greeting.split('(', 1)[1]}"
    scenario = Scenario.model_validate(
        {
            "schema_version": 1,
            "task_id": "tamper",
            "task_version": "1",
            "policy_id": "p",
            "policy_version": "1",
            "permissions": ["write_file", "run_verifier", "finish"],
            "allowed_paths": ["app.py"],
            "allowed_verifier_targets": ["unit"],
            "approval_required": [],
            "budgets": {"proposals": 8, "steps": 8, "wall_clock_seconds": 3600, "cost_units": 0},
            "initial_files": {},
            "verifier": {"target": "unit", "expected_files": {}},
        }
    )
    plan = [
        {"kind": "write_file", "args": {"path": "app.py", "content": app}},
        {"kind": "run_verifier", "args": {"target": "unit"}},
        {"kind": "finish", "args": {"summary": "done"}},
    ]
    return RunDocument(
        scenario=scenario,
        agent="scripted",
        agent_config={"steps": plan},
        environment=EnvironmentSpec(
            root=str(root.resolve()),
            verifiers={"unit": VerifierSpec(argv=(sys.executable, "test_app.py"))},
        ),
    )


def git_workspace(root: Path) -> Path:
    make_greeting_workspace(root)
    run_git(root, "init", "-q")
    run_git(root, "add", "app.py", "test_app.py")
    run_git(root, "commit", "-q", "-m", "initial")
    return root


def fake_git(tmp_path: Path, markers: Path) -> Path:
    """A folder whose `git` records that it ran: first on a worker's PATH."""
    folder = tmp_path / "fake-bin"
    folder.mkdir()
    (folder / "git").write_text(f"#!/bin/sh\necho ran >> {markers}/git-binary\nexit 1\n")
    (folder / "git").chmod(0o755)
    return folder


def ended(fleet: Fleet, run_id: str) -> bool:
    snap = fleet.store.read_run(run_id)
    return not snap.lease_live and inspect_run(fleet, run_id).state.phase.value in (
        "completed",
        "failed",
        "cancelled",
        "needs_review",
    )


def run_tampering_agent(
    settings: Settings, tmp_path: Path, *, greeting: str
) -> tuple[Fleet, str, Path, Path, dict[str, str]]:
    markers = tmp_path / "markers"
    markers.mkdir()
    root = git_workspace(tmp_path / "ws")
    fleet = Fleet.connect(settings)
    run_id = submit(fleet, tamper_document(root, markers, greeting=greeting))
    env = {"PATH": f"{fake_git(tmp_path, markers)}{os.pathsep}{os.environ['PATH']}"}
    with workers(settings) as pool:
        pool.start(1, env=env)
        poll(lambda: ended(fleet, run_id), deadline_s=120, what="the run ended")
    tamper = root / ".ratchet" / "verifier-home" / "tamper.json"
    results = json.loads(tamper.read_text()) if tamper.exists() else {}
    return fleet, run_id, root, markers, results


def test_a_planted_repository_configuration_never_runs_in_the_worker(
    settings: Settings, tmp_path: Path
) -> None:
    """Unconfined (the operator's explicit opt-out) the agent's code does write the
    repository's configuration; the worker still runs none of it, and no git at all."""
    settings = settings.model_copy(update={"verifier_sandbox": SandboxMode.NONE})
    fleet, run_id, root, markers, results = run_tampering_agent(
        settings, tmp_path, greeting=RIGHT_GREETING
    )
    assert results["git_config"] == "done"  # the plant has teeth
    assert "fsmonitor" in (root / ".git" / "config").read_text()
    view = inspect_run(fleet, run_id)
    assert view.state.phase.value == "completed", fleet.store.records.incidents(run_id)
    assert "git_head" in view.state.environment.details
    assert sorted(p.name for p in markers.iterdir()) == []


def test_under_bubblewrap_the_agent_s_code_cannot_change_git_its_test_or_a_module_beside_it(
    settings: Settings, tmp_path: Path
) -> None:
    require_sandbox()
    settings = settings.model_copy(update={"verifier_sandbox": SandboxMode.BWRAP})
    original_test = make_greeting_workspace(tmp_path / "fresh").joinpath("test_app.py").read_text()
    fleet, run_id, root, markers, results = run_tampering_agent(
        settings, tmp_path, greeting=WRONG_GREETING
    )
    assert results, "the verifier ran the agent's code"
    for name in ("git_config", "attributes", "hook", "test_rewrite", "shadow"):
        assert results[name] == "OSError", (name, results)
    assert "fsmonitor" not in (root / ".git" / "config").read_text()
    assert not (root / "subprocess.py").exists() and not (root / ".gitattributes").exists()
    assert (root / "test_app.py").read_text() == original_test
    assert inspect_run(fleet, run_id).state.phase.value != "completed"
    assert sorted(p.name for p in markers.iterdir()) == []


# -- paths that are not files -----------------------------------------------------------------


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _socket(path: Path) -> None:
    path.unlink()
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.close()


def _device(path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    path.unlink()
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers


@pytest.mark.parametrize(
    ("kind", "make"), [("fifo", _fifo), ("socket", _socket), ("char_device", _device)]
)
def test_every_workspace_read_refuses_a_path_that_is_not_a_file_without_blocking(
    tmp_path: Path, kind: str, make: object
) -> None:
    root = make_greeting_workspace(tmp_path / "ws")
    make(root / "app.py")  # type: ignore[operator]
    action = Action.model_validate(
        {
            "action_id": "r",
            "kind": "read_file",
            "risk": "read_only",
            "args": {"path": "app.py"},
            "expected_env_version": 0,
            "deadline_at": 2**40,
        }
    )
    outcome: dict[str, object] = {}

    def attempt() -> None:
        with WorkspaceAdapter(root, ["app.py"], git=False) as ws:
            for name, call in (("observe", ws.observe), ("read", lambda: ws.read(action))):
                try:
                    call()
                except UntrustedGroundError as exc:
                    outcome[name] = (exc.context["file_type"], exc.context["path"])

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "a workspace read blocked"
    assert outcome == {"observe": (kind, "app.py"), "read": (kind, "app.py")}


def test_a_worker_that_meets_a_fifo_stops_the_run_with_the_evidence_and_stays_free(
    settings: Settings, tmp_path: Path, workspace: object
) -> None:
    fleet = Fleet.connect(settings)
    make = workspace  # type: ignore[assignment]
    root, document = make(agent_config={"think_ms": 0})  # type: ignore[operator]
    run_id = submit(fleet, document)
    _fifo(root / "app.py")
    _, other_document = make()  # type: ignore[operator]
    with workers(settings) as pool:
        pool.start(1)
        poll(
            lambda: bool(fleet.store.records.incidents(run_id)),
            deadline_s=60,
            what="an incident for the FIFO",
        )
        # The worker is free: it takes and finishes another run.
        other = submit(fleet, other_document)
        poll(
            lambda: inspect_run(fleet, other).state.phase.value == "completed",
            deadline_s=60,
            what="the other run completed on the same worker",
        )
        poll(lambda: not fleet.store.read_run(run_id).lease_live, deadline_s=30, what="released")
    incident = fleet.store.records.incidents(run_id)[0]
    text = json.dumps(incident)
    assert "app.py" in text and "fifo" in text, incident
    assert inspect_run(fleet, run_id).state.phase.value != "completed"
    assert stat.S_ISFIFO(os.lstat(root / "app.py").st_mode)  # the evidence is kept
