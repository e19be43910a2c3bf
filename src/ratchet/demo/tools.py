"""The tools demo: a model-driven agent fixes a repository and files a ticket through an
MCP tool, on a fleet of real workers, with one worker killed mid-run.

1. start a private embedded ``redis-server`` (AOF on, ``appendfsync always``);
2. start a real MCP server (the tickets service of :mod:`ratchet.testing.mcp_server`,
   streamable HTTP on loopback) that dedupes by idempotency key and checks fences, and
   a stub of an OpenAI-compatible chat server (:class:`ratchet.testing.chat_stub.ChatStub`)
   whose "model" answers each conversation with the next tool call: read ``app.py``,
   write the fix, file a ticket, run the tests, then a summary;
3. submit ``runs`` runs of the greeting task with the ``tool_calling`` agent, the
   scenario permitting the MCP tool ``tickets_create_ticket``;
4. start ``workers`` worker processes; SIGKILL one while it holds a lease mid-run;
5. count, on the MCP server's side, how many tickets were created: one per run.

Both secrets are the workers' credentials (``RATCHET_CREDENTIALS``): the run document
names them (``model`` and ``tickets``), and the fleet's settings say which variable holds
each and that each may go only to its own server's URL.

The model's replies depend only on the conversation it is shown (the agent's signed
state), so a worker that takes a run over asks the same question and gets the same
answer; the keys come from the run and the step, never from the model. Every bound here
is a deadline: nothing waits forever.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.demo.examples import RIGHT_GREETING, greeting_document, make_greeting_workspace
from ratchet.demo.fleet import (
    demo_settings,
    owners_in_history,
    run_workers_and_kill_one,
    worker_settings,
)
from ratchet.errors import ConfigurationError
from ratchet.fleet.context import Fleet, ensure_embedded_redis, stop_embedded_redis
from ratchet.fleet.credentials import CredentialSpec
from ratchet.fleet.runs import EnvironmentSpec, McpServerSpec, RunDocument
from ratchet.ops import submit
from ratchet.redis_server import free_port
from ratchet.runtime import Phase, Scenario
from ratchet.testing.chat_stub import ChatStub
from ratchet.testing.mcp_server import stats

__all__ = [
    "MODEL_KEY_ENV",
    "TICKETS_KEY_ENV",
    "TICKET_TOOL",
    "ToolsDemoReport",
    "demo_credentials",
    "run_tools_demo",
    "scripted_turn",
]

#: The environment variable the workers read the (stub) model's API key from.
MODEL_KEY_ENV = "DEMO_MODEL_API_KEY"
#: The environment variable the workers read the MCP server's bearer token from.
TICKETS_KEY_ENV = "DEMO_TICKETS_TOKEN"
#: The ratchet name of the MCP server's ticket tool (prefix ``tickets_``).
TICKET_TOOL = "tickets_create_ticket"

SYSTEM_PROMPT = (
    "You fix the repository in the workspace so that its test passes, then file a ticket "
    "saying what you changed. Use the tools; answer with a one-line summary when done."
)


@dataclass
class ToolsDemoReport:
    runs: int
    completed: int
    tickets_created: int
    duplicate_effects: int
    greeting_fixed: int
    takeovers: int
    workers_killed: int
    workers: int
    model_requests: int
    elapsed_s: float
    phases: dict[str, str] = field(default_factory=dict)
    killed_holding: list[str] = field(default_factory=list)
    file_writes: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            self.completed == self.runs
            and self.tickets_created == self.runs
            and self.duplicate_effects == 0
            and self.greeting_fixed == self.runs
        )

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"tool_calls": [{"id": call_id, "name": name, "arguments": json.dumps(arguments)}]}


def scripted_turn(body: dict[str, Any], *, think_s: float = 0.0) -> dict[str, Any]:
    """The stub model's answer to one chat request: the next step of the fix, chosen by
    how many tool results the conversation holds already (so a resumed conversation gets
    the answer the lost one would have). ``think_s`` is the model's latency."""
    if think_s > 0:
        time.sleep(think_s)
    done = sum(1 for m in body.get("messages", []) if m.get("role") == "tool")
    steps = [
        _call("c1", "read_file", {"path": "app.py"}),
        _call("c2", "write_file", {"path": "app.py", "content": RIGHT_GREETING}),
        _call(
            "c3",
            TICKET_TOOL,
            {"title": "Fix the greeting", "body": "app.py printed 'wrold'; it prints 'world'."},
        ),
        # Last: a finish needs a passing check of the environment as it is at the end,
        # and filing the ticket moved the environment on (its tools part).
        _call("c4", "run_verifier", {"target": "unit"}),
    ]
    if done < len(steps):
        return steps[done]
    return {"content": "Fixed the greeting in app.py and filed a ticket."}


def demo_credentials(base_url: str, mcp_url: str) -> dict[str, CredentialSpec]:
    """The fleet's ``RATCHET_CREDENTIALS``: each secret, and the one server it may go to."""
    return {
        "model": CredentialSpec(env=MODEL_KEY_ENV, destinations=(base_url,)),
        "tickets": CredentialSpec(env=TICKETS_KEY_ENV, destinations=(mcp_url,)),
    }


def _document(root: Path, mcp_url: str, base_url: str) -> RunDocument:
    plain = greeting_document(root, runner="python")
    scenario = Scenario.model_validate(
        {
            **plain.scenario.model_dump(mode="json"),
            "permissions": [*plain.scenario.permissions, TICKET_TOOL],
        }
    )
    return RunDocument(
        scenario=scenario,
        agent="tool_calling",
        agent_config={
            "model": {
                "kind": "openai",
                "base_url": base_url,
                "model": "stub-model",
                "credential": "model",  # the workers' credential, by name
            },
            "system_prompt": SYSTEM_PROMPT,
        },
        environment=EnvironmentSpec(
            root=plain.environment.root,
            verifiers=plain.environment.verifiers,
            mcp={"tickets": McpServerSpec(url=mcp_url, prefix="tickets_", credential="tickets")},
        ),
    )


def _wait_listening(port: int, proc: subprocess.Popen[bytes], deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigurationError("the MCP tickets server exited during start-up")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise ConfigurationError("the MCP tickets server did not start in time")


def run_tools_demo(
    *,
    runs: int = 2,
    workers: int = 3,
    lease_ttl_ms: int = 2000,
    think_ms: int = 200,
    deadline_s: float = 240.0,
    state_dir: Path | None = None,
) -> ToolsDemoReport:
    """Run the demo and return its report. Raises ConfigurationError on a bad setup."""
    if runs < 1 or workers < 2:
        raise ConfigurationError("the demo needs at least one run and two workers")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ratchet-tools-demo-") as tmp:
        base = Path(state_dir) if state_dir is not None else Path(tmp)
        settings = demo_settings(base, name="tools-demo", lease_ttl_ms=lease_ttl_ms)
        tickets = base / "tickets"
        tickets.mkdir(parents=True, exist_ok=True)
        port = free_port()
        mcp_url = f"http://127.0.0.1:{port}/mcp"
        ticket_token = os.urandom(16).hex()
        server = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
            [
                sys.executable,
                "-m",
                "ratchet.testing.mcp_server",
                "--state",
                str(tickets),
                "--transport",
                "http",
                "--port",
                str(port),
                "--fences",
                "--sep3182",
                "--idempotent",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "TICKETS_TOKEN": ticket_token},  # it requires the token
        )
        key = os.urandom(16).hex()
        previous = {name: os.environ.get(name) for name in (MODEL_KEY_ENV, TICKETS_KEY_ENV)}
        # The workers (spawned) inherit both; the settings say where each may go.
        os.environ.update({MODEL_KEY_ENV: key, TICKETS_KEY_ENV: ticket_token})
        stub = ChatStub(lambda body: scripted_turn(body, think_s=think_ms / 1000), api_key=key)
        url = ""
        try:
            _wait_listening(port, server, 30.0)
            stub.start()
            settings = settings.model_copy(
                update={"credentials": demo_credentials(stub.base_url, mcp_url)}
            )
            url = ensure_embedded_redis(settings.state_dir)
            fleet = Fleet.connect(settings)
            child = worker_settings(settings, url)
            roots: dict[str, Path] = {}
            for index in range(runs):
                root = make_greeting_workspace(base / "workspaces" / f"ws-{index}")
                run_id = submit(
                    fleet,
                    _document(root, mcp_url, stub.base_url),
                    run_id=f"tools-demo-{index}-{os.getpid()}",
                )
                roots[run_id] = root
            run_ids = list(roots)
            phases, killed, started_workers = run_workers_and_kill_one(
                fleet, child, run_ids, workers=workers, deadline_s=deadline_s
            )
            writes: dict[str, int] = {}
            for run_id, root in roots.items():
                with WorkspaceAdapter(root, ["app.py"]) as adapter:
                    writes[run_id] = adapter.effects
            counted = stats(tickets)
            fixed = sum((root / "app.py").read_text() == RIGHT_GREETING for root in roots.values())
            return ToolsDemoReport(
                runs=runs,
                completed=sum(1 for p in phases.values() if p == Phase.COMPLETED.value),
                tickets_created=counted.effects,
                duplicate_effects=max(0, counted.effects - runs)
                + sum(max(0, n - 1) for n in writes.values()),
                greeting_fixed=fixed,
                takeovers=sum(1 for r in run_ids if len(owners_in_history(fleet, r)) > 1),
                workers_killed=len(killed),
                workers=started_workers,
                model_requests=len(stub.requests),
                elapsed_s=round(time.monotonic() - started, 2),
                phases=phases,
                killed_holding=killed,
                file_writes=writes,
            )
        finally:
            stub.close()
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
            if url:
                stop_embedded_redis(settings.state_dir)
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
