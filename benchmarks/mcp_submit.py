"""What ``ratchet submit`` of a run that names a stdio MCP server costs, by route.

A stdio MCP server reaches a fleet two ways (docs/mcp.md): a tool package whose factory
builds the tool over ``shared_stdio`` (submit loads the package, so it starts the server
and lists its tools), or a server the operator declares in the workers' settings
(``RATCHET_MCP_SERVERS``), which a task file names and submit only checks against its own
declaration, starting nothing. Measured here, in one process against a real
``redis-server`` (AOF ``always``), the wall time of :func:`ratchet.ops.submit` for:

* ``plain``: a run that permits no tool (the floor: the document, generation 1, the
  enqueue);
* ``declared``: a run that permits ``create_ticket`` of the tickets server
  (``python -m ratchet.testing.mcp_server``) declared in the settings;
* ``package``: the same tool from a tool package over ``shared_stdio``; before each submit
  the process's shared servers are closed, as a fresh ``ratchet submit`` process has
  none, so the submit starts the server, handshakes and lists its tools.

Rounds are interleaved (every round submits one run of each kind, in rotating order), so
a noisy machine affects all alike. Printed: the median wall time per kind and each kind
over ``plain`` (``declared_over_plain``, ``package_over_plain``), and ``package`` over
``declared``. ``--json`` prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from mcp_calls import PACKAGE, SERVER, _installed

KINDS = ("plain", "declared", "package")


def _document(kind: str, folder: Path) -> Any:
    from ratchet.fleet.runs import (
        EnvironmentSpec,
        McpServerSpec,
        RunDocument,
        ToolCheckSpec,
        VerifierSpec,
    )
    from ratchet.runtime import Scenario

    tools = [] if kind == "plain" else ["tk_create_ticket", "tk_list_tickets"]
    scenario = Scenario.model_validate(
        {
            "schema_version": 1,
            "task_id": "mcp-submit",
            "task_version": "1",
            "policy_id": "default",
            "policy_version": "1",
            "permissions": ["run_verifier", "finish", *tools],
            "allowed_paths": ["notes.txt"] if kind == "plain" else [],
            "allowed_verifier_targets": ["filed"],
            "approval_required": [],
            "budgets": {"proposals": 8, "steps": 8, "wall_clock_seconds": 600, "cost_units": 0},
            "initial_files": {},
            "verifier": {"target": "filed"},
        }
    )
    if kind == "plain":  # no tool at all: a folder and the cheapest verifier
        root = folder / "ws-plain"
        root.mkdir(parents=True, exist_ok=True)
        environment = EnvironmentSpec(
            root=str(root), git=False, verifiers={"filed": VerifierSpec(argv=("true",))}
        )
    else:
        check = ToolCheckSpec(tool="tk_list_tickets", contains=("ticket",))
        mcp = {"tickets": McpServerSpec(server="tickets", prefix="tk_")}
        environment = EnvironmentSpec(
            kind="tools",
            checks={"filed": check},
            # the package's runs find both tools among the installed entry points
            mcp=mcp if kind == "declared" else {},
        )
    return RunDocument(
        scenario=scenario,
        agent="scripted",
        agent_config={"steps": [{"kind": "finish", "args": {"summary": "done"}}]},
        environment=environment,
    )


PACKAGE_LIST = f"""
def shared_list():
    from ratchet.tools.mcp import mcp_tools, shared_stdio
    import {PACKAGE}
    return mcp_tools(shared_stdio({PACKAGE}.SHARED_ARGV), prefix="tk_",
                     include=["list_tickets"])[0]
"""


def measure(*, rounds: int) -> dict[str, Any]:
    from harness import median, ratio, temp_redis
    from pydantic import SecretStr

    from ratchet.adapters.sandbox import SandboxMode
    from ratchet.fleet.context import Fleet
    from ratchet.fleet.mcp_servers import McpServerDeclaration
    from ratchet.fleet.settings import Settings
    from ratchet.leasing import RedisStore
    from ratchet.ops import submit
    from ratchet.tools.mcp import close_shared

    walls: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with temp_redis(prefix="ratchet-mcp-submit-") as (server, folder):
        RedisStore(server.client()).identity.init_epoch()
        tickets = folder / "tickets"
        declared = McpServerDeclaration.model_validate(
            {
                "command": [*SERVER, "--state", str(tickets / "declared")],
                "tools": {"create_ticket": {}, "list_tickets": {"risk": "read_only"}},
            }
        )
        settings = Settings(
            redis_url=SecretStr(server.url),
            state_dir=folder / "state",
            queue=f"mcp-submit-{secrets.token_hex(3)}",
            checkpoint_key=SecretStr(secrets.token_hex(32)),
            worker_name="mcp-submit",
            verifier_sandbox=SandboxMode.NONE,
            mcp_servers={"tickets": declared},
        )
        fleet = Fleet.connect(settings)
        with _installed(folder, tickets) as module:
            exec(PACKAGE_LIST, module.__dict__)
            site = Path(module.__file__).parent
            info = site / f"{PACKAGE}-1.0.dist-info" / "entry_points.txt"
            info.write_text(info.read_text() + f"tk_list_tickets = {PACKAGE}:shared_list\n")
            importlib.invalidate_caches()
            documents = {kind: _document(kind, folder) for kind in KINDS}
            count = 0
            for round_no in range(rounds + 1):  # round 0 warms up (imports, scripts)
                order = KINDS[round_no % 3 :] + KINDS[: round_no % 3]
                for kind in order:
                    close_shared()  # a fresh submit process holds no server
                    count += 1
                    started = time.perf_counter()
                    submit(fleet, documents[kind], run_id=f"s-{kind}-{count}")
                    took = time.perf_counter() - started
                    if round_no:
                        walls[kind].append(took)
            close_shared()
    med = {kind: median(values) for kind, values in walls.items()}
    return {
        "rounds": rounds,
        "submit_ms": {kind: round(value * 1000, 2) for kind, value in med.items()},
        "declared_over_plain": ratio(med["declared"], med["plain"], 2),
        "package_over_plain": ratio(med["package"], med["plain"], 2),
        "package_over_declared": ratio(med["package"], med["declared"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = measure(rounds=args.rounds)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for kind, value in report["submit_ms"].items():
        print(f"submit {kind:9s} {value:9.2f} ms (median of {args.rounds})")
    for name in ("declared_over_plain", "package_over_plain", "package_over_declared"):
        print(f"{name:22s} {report[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
