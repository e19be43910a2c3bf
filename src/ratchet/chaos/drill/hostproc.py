"""The processes the multi-host drill starts inside a host (``python -m`` this module).

* ``worker INDEX``: one worker process (``worker_main``, RQ and a reaper), its settings
  read from the ``RATCHET_*`` environment *inside* the host, so its host is the host name
  the namespace set (no ``RATCHET_HOST``), with the drill's hooks
  (``RATCHET_FAILPOINTS``, the event log): SIGKILL at the crash windows;
* ``submitter``: the host's submitter. It reads one JSON request a line on stdin
  (``index``, ``run_id``, ``orders_url``, ``think_ms``, and ``remote`` for a git run),
  makes the run's workspace on this host's disk (its working directory) unless it exists
  (a task submitted again), and submits the drill's run through :func:`ratchet.ops.submit`,
  so the signed document names this host; a git run (``remote``: the remote's URL) has no
  workspace here: submit makes its branch on the remote and binds it to no host. It
  answers one JSON line on stdout (``ok``, ``run_id``, ``host``, or ``error``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ratchet.chaos.drill.hostgit import git_document
from ratchet.chaos.drill.services import drill_document, make_workspace
from ratchet.chaos.hooks import from_env
from ratchet.errors import RatchetError
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.ops import submit
from ratchet.worker.pool import _settings_json, worker_main

__all__ = ["main", "workspace_name"]


def workspace_name(index: int) -> str:
    """Run ``index``'s workspace folder, relative to its host's disk."""
    return f"ws-{index}"


def _submitter() -> int:
    fleet = Fleet.connect()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            index = int(request["index"])
            think_ms = int(request["think_ms"])
            if request.get("remote"):
                document = git_document(
                    str(request["remote"]), str(request["orders_url"]), index, think_ms=think_ms
                )
            else:
                root = Path.cwd() / workspace_name(index)
                if not root.exists():
                    make_workspace(root)
                document = drill_document(
                    root, str(request["orders_url"]), index, think_ms=think_ms
                )
            run_id = submit(fleet, document, run_id=str(request["run_id"]))
            reply = {"ok": True, "run_id": run_id, "host": fleet.settings.host}
        except (RatchetError, OSError, ValueError, KeyError) as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"] and len(argv) == 2 and argv[1].isdigit():
        worker_main(_settings_json(Settings()), int(argv[1]), False, hooks_factory=from_env)
        return 0
    if argv == ["submitter"]:
        return _submitter()
    sys.stderr.write("usage: python -m ratchet.chaos.drill.hostproc worker INDEX | submitter\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
