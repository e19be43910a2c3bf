"""The spec's example task, ready to run: a workspace whose ``app.py`` prints the wrong
greeting, a real ``pytest`` verifier, and the greeting agent that fixes it.

Used by ``ratchet demo``, by ``ratchet submit --example greeting``, and by the tests.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from ratchet.fleet.runs import EnvironmentSpec, RunDocument, VerifierSpec
from ratchet.runtime import Scenario

__all__ = [
    "RIGHT_GREETING",
    "WRONG_GREETING",
    "greeting_document",
    "greeting_scenario",
    "make_greeting_workspace",
]

WRONG_GREETING = 'print("Hello, wrold")\n'
RIGHT_GREETING = 'print("Hello, world")\n'

_TEST = """import subprocess
import sys
from pathlib import Path


def test_app_prints_the_greeting():
    app = Path(__file__).with_name("app.py")
    out = subprocess.run([sys.executable, str(app)], capture_output=True, text=True,
                         check=True, timeout=60)
    if out.stdout != "Hello, world\\n":
        raise AssertionError(f"unexpected greeting: {out.stdout!r}")


if __name__ == "__main__":  # runnable without pytest too
    test_app_prints_the_greeting()
"""


def make_greeting_workspace(root: Path) -> Path:
    """Create the example workspace in ``root`` (made if missing) and return it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "app.py").write_text(WRONG_GREETING)
    (root / "test_app.py").write_text(_TEST)
    return root


def greeting_scenario(
    *, approval_required: tuple[str, ...] = (), budgets: dict[str, int] | None = None
) -> Scenario:
    return Scenario.model_validate(
        {
            "schema_version": 1,
            "task_id": "fix-greeting",
            "task_version": "1",
            "policy_id": "default",
            "policy_version": "1",
            "permissions": ["read_file", "write_file", "run_verifier", "finish"],
            "allowed_paths": ["app.py"],
            "allowed_verifier_targets": ["unit"],
            "approval_required": list(approval_required),
            "budgets": budgets
            or {"proposals": 30, "steps": 20, "wall_clock_seconds": 3600, "cost_units": 0},
            "initial_files": {"app.py": WRONG_GREETING},
            "verifier": {"target": "unit", "expected_files": {"app.py": RIGHT_GREETING}},
        }
    )


def greeting_document(
    root: Path,
    *,
    agent_config: dict[str, Any] | None = None,
    approval_required: tuple[str, ...] = (),
    runner: str = "auto",
) -> RunDocument:
    """The run document of the example task on the workspace at ``root``.

    ``runner``: ``pytest`` runs the test with pytest, ``python`` runs the test file as a
    script (no test dependencies needed), ``auto`` picks pytest when it is installed.
    """
    if runner == "auto":
        runner = "pytest" if importlib.util.find_spec("pytest") is not None else "python"
    argv: tuple[str, ...] = (
        (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_app.py")
        if runner == "pytest"
        else (sys.executable, "test_app.py")
    )
    verifier = VerifierSpec(argv=argv, timeout_seconds=120)
    return RunDocument(
        scenario=greeting_scenario(approval_required=approval_required),
        agent="greeting",
        agent_config=agent_config or {},
        environment=EnvironmentSpec(root=str(root.resolve()), verifiers={"unit": verifier}),
    )
