"""Shared pieces of the operations tests: runs in the states operators look at (waiting for
a review, waiting for an approval), trust files, polling with a deadline, free loopback
ports and a Prometheus scrape."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from prometheus_client.parser import text_string_to_metric_families

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.demo.examples import RIGHT_GREETING
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.ops import submit
from ratchet.runtime import Fence, derive_idempotency_key, parse_action
from ratchet.worker.job import execute_run

MakeWorkspace = Callable[..., tuple[Path, RunDocument]]

PLAN = [
    {"kind": "write_file", "args": {"path": "app.py", "content": RIGHT_GREETING}},
    {"kind": "run_verifier", "args": {"target": "unit"}},
    {"kind": "finish", "args": {"summary": "fixed"}},
]


def public_hex(key: Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def trust_file(path: Path, signers: dict[str, Ed25519PrivateKey]) -> Path:
    path.write_text(json.dumps({name: public_hex(key) for name, key in signers.items()}))
    return path


def with_trust(fleet: Fleet, **files: Path) -> Fleet:
    """The same fleet with trust files (``approvers_file=...``, ``reviewers_file=...``)."""
    return Fleet.connect(fleet.settings.model_copy(update=files))


def run_in_review(fleet: Fleet, workspace: MakeWorkspace, run_id: str) -> str:
    """A run frozen in needs_review: another caller already used its idempotency key for
    another intent (an ``intent_conflict`` with a real receipt)."""
    root, document = workspace()
    document = document.model_copy(update={"agent": "scripted", "agent_config": {"steps": PLAN}})
    key = derive_idempotency_key(run_id, 0, salt="0")
    with WorkspaceAdapter(root, ["app.py"]) as other:
        foreign = parse_action(
            {
                "action_id": "x-1",
                "kind": "write_file",
                "risk": "reversible_write",
                "args": {"path": "app.py", "content": "print('other')\n"},
                "idempotency_key": key,
                "expected_env_version": other.observe().version,
                "deadline_at": 2**40,
            }
        )
        other.execute(
            foreign,
            foreign.intent_digest,
            Fence(run_id="someone-else", lease_version=1, state_version=1),
            None,
        )
    submit(fleet, document, run_id=run_id)
    report = execute_run(fleet, run_id, owner="w-review")
    if report.phase != "needs_review":
        raise AssertionError(f"expected needs_review, got {report}")
    return run_id


def run_awaiting_approval(fleet: Fleet, workspace: MakeWorkspace, run_id: str) -> str:
    """A run whose first write needs a signed approval."""
    _root, document = workspace(approval_required=("write_file",))
    submit(fleet, document, run_id=run_id)
    report = execute_run(fleet, run_id, owner="w-approve")
    if report.phase != "awaiting_approval":
        raise AssertionError(f"expected awaiting_approval, got {report}")
    return run_id


def poll(predicate: Callable[[], bool], *, deadline_s: float, what: str) -> None:
    """Poll until true or fail after the deadline (never a fixed sleep to synchronise)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for: {what}")


def free_block(n: int) -> int:
    """A base port with ``n`` consecutive free loopback ports."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + n >= 65536:
            continue
        try:
            socks = []
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise AssertionError("no block of free ports")


def scrape(port: int) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))
            values[key] = s.value
    return values
