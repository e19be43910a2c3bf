"""A receipt conflict whose foreign write moved the environment, resolved with
``ratchet review`` on a real fleet: real worker processes, a real Redis, a real workspace.

The foreign write lands while the run is between its restore and its write (the worker is
stopped there by a failpoint), as any real foreign write does: the workspace's version
moves. The case must record the environment as it is then, so that a reviewer's decision
bound to it can be consumed: replan finishes the run with a new key, abort ends it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.demo.examples import RIGHT_GREETING, greeting_document, make_greeting_workspace
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run, submit
from ratchet.redis_server import RedisServer
from ratchet.runtime import Fence, derive_idempotency_key, parse_action
from tests.worker.conftest import CHECKPOINT_KEY_HEX
from tests.worker.fleet_harness import phase, poll, process_state, workers

pytestmark = [pytest.mark.slow, pytest.mark.sandbox]

PLAN = [
    {"kind": "write_file", "args": {"path": "app.py", "content": RIGHT_GREETING}},
    {"kind": "run_verifier", "args": {"target": "unit"}},
    {"kind": "finish", "args": {"summary": "fixed"}},
]
FOREIGN = "print('written by another caller')\n"


def foreign_write(root: Path, key: str) -> int:
    """Another caller writes app.py under ``key``, for another intent. Returns the
    workspace version after it."""
    with WorkspaceAdapter(root, ["app.py"]) as other:
        action = parse_action(
            {
                "action_id": "x-1",
                "kind": "write_file",
                "risk": "reversible_write",
                "args": {"path": "app.py", "content": FOREIGN},
                "idempotency_key": key,
                "expected_env_version": other.observe().version,
                "deadline_at": 2**40,
            }
        )
        other.execute(
            action,
            action.intent_digest,
            Fence(run_id="someone-else", lease_version=1, state_version=1),
            None,
        )
        return other.observe().version


def effects(root: Path) -> int:
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        return adapter.effects


@pytest.mark.parametrize(
    ("verdict", "final", "writes"), [("replan", "completed", 2), ("abort", "failed", 1)]
)
def test_ratchet_review_resolves_a_conflict_whose_foreign_write_moved_the_version(
    settings: Settings,
    redis_server: RedisServer,
    tmp_path: Path,
    verdict: str,
    final: str,
    writes: int,
) -> None:
    rita = Ed25519PrivateKey.generate()
    trust = tmp_path / "reviewers.json"
    trust.write_text(
        json.dumps({"rita": rita.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()})
    )
    pem = tmp_path / "reviewer-rita.pem"
    pem.write_bytes(rita.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    # A lease long enough that the short stop below never costs the worker its lease.
    settings = settings.model_copy(
        update={"reviewers_file": trust, "lease_ttl_ms": 6000, "renew_interval_ms": 1000}
    )
    fleet = Fleet.connect(settings)
    root = make_greeting_workspace(tmp_path / "ws")
    document = greeting_document(root).model_copy(
        update={"agent": "scripted", "agent_config": {"steps": PLAN}}
    )
    run_id = submit(fleet, document, run_id=f"r-moved-{verdict}")
    key = derive_idempotency_key(run_id, 0, salt="0")  # what the scripted agent derives

    with workers(settings) as pool:
        (worker,) = pool.start(1, env={"RATCHET_FAILPOINTS": "before_proposal=pause@1"})
        assert worker.pid is not None
        poll(
            lambda: process_state(worker.pid or 0) == "T",
            deadline_s=60,
            what="the worker stopped right before its first proposal",
        )
        moved_to = foreign_write(root, key)
        os.kill(worker.pid, signal.SIGCONT)
        poll(
            lambda: phase(fleet, run_id) == "needs_review",
            deadline_s=60,
            what="the run frozen by the conflict",
        )
        case = inspect_run(fleet, run_id).state.review
        assert case is not None and case.reason.value == "intent_conflict"
        assert case.environment.version == moved_to  # observed when the case opened
        assert effects(root) == 1  # only the foreign write

        env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
        env.update(
            RATCHET_REDIS_URL=redis_server.url,
            RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX,
            RATCHET_QUEUE=settings.queue,
            RATCHET_REVIEWERS_FILE=str(trust),
            RATCHET_LOG_LEVEL="WARNING",
        )
        decided = subprocess.run(
            [
                sys.executable,
                "-m",
                "ratchet.cli.entry",
                "review",
                run_id,
                "--decision",
                verdict,
                "--key",
                str(pem),
                "--json",
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert decided.returncode == 0, decided.stderr
        assert json.loads(decided.stdout)["verified"] is True
        poll(
            lambda: phase(fleet, run_id) == final,
            deadline_s=60,
            what=f"the run {final} after the {verdict} decision",
        )

    view = inspect_run(fleet, run_id)
    assert view.state.closed_reviews[-1].decision is not None
    assert view.state.closed_reviews[-1].receipt == case.receipt  # evidence kept
    assert not [i for i in view.incidents if i.get("kind") == "evidence_refused"]
    assert effects(root) == writes
    expected = RIGHT_GREETING if verdict == "replan" else FOREIGN
    assert (root / "app.py").read_text() == expected
    if verdict == "replan":
        assert key in view.state.quarantined_keys
