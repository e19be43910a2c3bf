"""Play "another caller" that writes the workspace's app.py under a run's idempotency key.

Used by the walkthrough (``examples/README.md``) to provoke the conflict ratchet is built
to catch: the run's write key already has a receipt at the adapter, for another intent.
It writes through the same workspace adapter the workers use, under a fence of its own::

    python greeting/other_writer.py conflict/workspace RUN_ID

The key is the one ``greeting.agent`` derives for its write (position 1, no replan yet),
so the run's own write, when it comes, finds the key taken.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.runtime import Fence, derive_idempotency_key, parse_action

WRITE_POSITION = 1  # greeting.agent.WRITE
CONTENT = 'print("Hello, wrold")  # edited by another caller\n'


def write_under_run_key(root: Path, run_id: str) -> str:
    """Write ``CONTENT`` to ``root/app.py`` under the run's write key; return the key."""
    key = derive_idempotency_key(run_id, WRITE_POSITION, salt="0")
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        action = parse_action(
            {
                "action_id": "other-1",
                "kind": "write_file",
                "risk": "reversible_write",
                "args": {"path": "app.py", "content": CONTENT},
                "idempotency_key": key,
                "expected_env_version": adapter.observe().version,
                "deadline_at": 2**40,
            }
        )
        adapter.execute(
            action,
            action.intent_digest,
            Fence(run_id="another-caller", lease_version=1, state_version=1),
            None,
        )
    return key


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: other_writer.py WORKSPACE RUN_ID")
    print(f"wrote app.py under {write_under_run_key(Path(sys.argv[1]), sys.argv[2])}")
