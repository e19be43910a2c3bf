"""What a drill's runs write to: a workspace each, and the reference orders API.

Each run gets its own workspace folder and its own orders *tenant*: one
:class:`~ratchet.chaos.orders.OrdersService` (its own SQLite database), all
served by one loopback HTTP server under ``/t/<tenant>``. Why not one shared service: the
orders API's observation is its global revision, so any other run's order would move it,
and a run recovering after a crash would (correctly) fail closed on the drift. A tenant per
run keeps each run's environment its own, exactly as the workspace is.

The drill agent plays a fixed plan (read, write, place an order, write again, verify,
finish) and "thinks" a little before each step, as a model would, so faults land mid-run.
With the ``approvals`` fault a seeded quarter of the runs need an approval for their
order (:mod:`ratchet.chaos.drill.humans` plays the approver); the others need none.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import Any, cast

from ratchet.agents import AgentStep, AgentView, ScriptedAgent
from ratchet.chaos.orders import OrdersService, _Handler
from ratchet.errors import ConfigurationError
from ratchet.fleet.runs import EnvironmentSpec, RunDocument, VerifierSpec
from ratchet.runtime import Scenario

__all__ = [
    "DrillAgent",
    "TenantOrders",
    "drill_agent",
    "drill_document",
    "expected_note",
    "make_workspace",
    "order_body",
    "plan",
]

NOTE = "note.txt"
#: Writes each run intends: two file writes and one order.
INTENTS_PER_RUN = 3


def expected_note(index: int) -> str:
    return f"run {index}: done\n"


def order_body(index: int) -> str:
    return f'{{"qty":1,"run":{index},"sku":"drill-{index}"}}'


def plan(index: int) -> list[dict[str, Any]]:
    """The drill run's plan: every write is an intent with a key fixed by its position."""
    return [
        {"kind": "read_file", "args": {"path": NOTE}},
        {"kind": "write_file", "args": {"path": NOTE, "content": f"run {index}: step 1\n"}},
        {"kind": "external_call", "args": {"operation": "place-order", "body": order_body(index)}},
        {"kind": "write_file", "args": {"path": NOTE, "content": expected_note(index)}},
        {"kind": "run_verifier", "args": {"target": "check"}},
        {"kind": "finish", "args": {"summary": "drill plan done"}},
    ]


class DrillAgent:
    """The scripted plan, with ``think_ms`` of latency before each proposal."""

    def __init__(self, steps: list[dict[str, Any]], think_ms: int) -> None:
        self._inner = ScriptedAgent(steps)
        self.think_ms = think_ms
        # Without a think delay it plans ahead: receipt commits then travel with the next
        # proposal's commit, and the drill's faults hit the coalesced path.
        self.plans_ahead = think_ms == 0

    def next_step(self, view: AgentView) -> AgentStep | None:
        if self.think_ms:
            time.sleep(self.think_ms / 1000)
        return self._inner.next_step(view)


def drill_agent(config: dict[str, Any]) -> DrillAgent:
    """Agent factory (``ratchet.chaos.drill.services:drill_agent``).

    Raises ConfigurationError for a bad ``think_ms`` or plan.
    """
    think = config.get("think_ms", 0)
    if isinstance(think, bool) or not isinstance(think, int) or not 0 <= think <= 10_000:
        raise ConfigurationError("think_ms must be an integer 0..10000", field="think_ms")
    steps = config.get("steps")
    if not isinstance(steps, list):
        raise ConfigurationError("the drill agent needs a 'steps' list", field="steps")
    return DrillAgent(steps, think)


def _scenario(index: int, *, approval: bool = False) -> Scenario:
    return Scenario.model_validate(
        {
            "schema_version": 1,
            "task_id": "drill-order",
            "task_version": "1",
            "policy_id": "drill",
            "policy_version": "1",
            "permissions": ["read_file", "write_file", "external_call", "run_verifier", "finish"],
            "allowed_paths": [NOTE],
            "allowed_verifier_targets": ["check"],
            "allowed_operations": ["place-order"],
            # The approvals fault's runs wait for a signed approval of their order.
            "approval_required": ["external_call"] if approval else [],
            # Generous: every crash re-proposes the step it died in.
            "budgets": {
                "proposals": 400,
                "steps": 300,
                "wall_clock_seconds": 24 * 3600,
                "cost_units": 0,
            },
            "initial_files": {NOTE: "draft\n"},
            "verifier": {"target": "check", "expected_files": {NOTE: expected_note(index)}},
        }
    )


def make_workspace(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / NOTE).write_text("draft\n")
    return root


def drill_document(
    root: Path, base_url: str, index: int, *, think_ms: int, approval: bool = False
) -> RunDocument:
    """The run document of drill run ``index`` (its order needs an approval when
    ``approval``). Raises ConfigurationError without grep."""
    grep = shutil.which("grep", path="/usr/bin:/bin")
    if grep is None:
        raise ConfigurationError("the drill's verifier needs grep in /usr/bin or /bin")
    verifier = VerifierSpec(
        argv=(grep, "-qx", expected_note(index).rstrip("\n"), NOTE), timeout_seconds=60
    )
    return RunDocument(
        scenario=_scenario(index, approval=approval),
        agent="drill",
        agent_config=cast(Any, {"think_ms": think_ms, "steps": plan(index)}),
        environment=EnvironmentSpec(
            root=str(root.resolve()), verifiers={"check": verifier}, http_base_url=base_url
        ),
    )


class _TenantServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], tenants: dict[str, OrdersService]) -> None:
        self.tenants = tenants
        self.dropped = 0
        self.token: str | None = None  # the drill's own loopback service: no token
        self.read_timeout_s = 30.0  # generous: drill workers are paused and resumed
        super().__init__(address, _TenantHandler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A worker killed mid-request resets its connection: expected in a drill, and
        # the order's outcome is settled by the service's transaction, not by the socket.
        self.dropped += 1


class _Routed:
    """What the reference handler sees as its server: one tenant's service."""

    def __init__(self, service: OrdersService) -> None:
        self.service = service


class _TenantHandler(_Handler):
    _home: Any = None  # the tenants' server (self.server is one tenant's, once routed)

    def _route(self) -> bool:
        # Each request of a kept-alive connection is routed afresh, from the tenants'
        # server, not from the tenant the connection's previous request went to.
        if self._home is None:
            self._home = self.server
        self.server = self._home
        parts = self.path.split("/", 3)  # "", "t", tenant, rest
        tenants: dict[str, OrdersService] = getattr(self.server, "tenants", {})
        if len(parts) < 4 or parts[1] != "t" or parts[2] not in tenants:
            self._reply(404, {"error": "no_tenant"})
            return False
        self.server = _Routed(tenants[parts[2]])  # type: ignore[assignment]
        self.path = "/" + parts[3]
        return True

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        if self._route():
            super().do_GET()

    def do_POST(self) -> None:  # noqa: N802 - the http.server name
        if self._route():
            super().do_POST()


class _FolderTenants(dict[str, OrdersService]):
    """The tenants of a folder, opened on first use: a service process started (or
    restarted) on the folder serves every tenant whose database the drill created."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder
        # One service object per tenant: opening one forgets the requests in flight.
        self._lock = threading.Lock()

    def _path(self, name: str) -> Path | None:
        if not name or not name.isalnum():
            return None
        path = self.folder / f"{name}.sqlite3"
        return path if path.exists() else None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (
            dict.__contains__(self, name) or self._path(name) is not None
        )

    def __missing__(self, name: str) -> OrdersService:
        path = self._path(name)
        if path is None:
            raise KeyError(name)
        with self._lock:
            if dict.__contains__(self, name):
                return dict.__getitem__(self, name)
            service = self[name] = OrdersService(path)
        return service


def _serve_folder(folder: str, port: int) -> None:
    """The orders service process: every tenant of ``folder`` on ``port`` (loopback).

    A restart after SIGKILL binds the same port (``SO_REUSEADDR``), retried for a few
    seconds while the old socket is released."""
    deadline = time.monotonic() + 10.0
    while True:
        try:
            server = _TenantServer(("127.0.0.1", port), _FolderTenants(Path(folder)))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    server.serve_forever(poll_interval=0.05)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TenantOrders:
    """One loopback HTTP server for many orders tenants (one SQLite database each).

    ``process=True`` serves them from a process of its own (so a drill can SIGKILL it
    mid-write and start it again on the same port and databases: :meth:`kill`,
    :meth:`restart`); otherwise from a thread of this process.
    """

    def __init__(self, folder: Path, *, process: bool = False) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.tenants: dict[str, OrdersService] = {}
        self._proc: BaseProcess | None = None
        self.restarts = 0
        if process:
            self._server = None
            self.port = _free_port()
            self._spawn()
            return
        self._server = _TenantServer(("127.0.0.1", 0), self.tenants)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="drill-orders",
            daemon=True,
        )
        self._thread.start()

    def _spawn(self) -> None:
        """Start the service process and wait (bounded) until it accepts connections.

        Raises ConfigurationError when it does not."""
        ctx = mp.get_context("spawn")
        proc = ctx.Process(
            target=_serve_folder, args=(os.fspath(self.folder), self.port), daemon=True
        )
        proc.start()
        self._proc = proc
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            if proc.exitcode is not None:
                break
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5),
            ):
                return
            time.sleep(0.02)
        raise ConfigurationError("the orders service process did not start", port=self.port)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def kill(self) -> None:
        """SIGKILL the service process (process mode only) and wait for it to exit."""
        proc = self._proc
        if proc is None or proc.pid is None:
            raise ConfigurationError("the orders service runs in this process", field="process")
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)

    def restart(self) -> None:
        """Start the service process again, on the same port and databases."""
        self.restarts += 1
        self._spawn()

    def __repr__(self) -> str:
        return f"TenantOrders(port={self.port}, tenants={len(self.tenants)})"

    def add(self, name: str) -> str:
        """Create tenant ``name`` (its database); returns its base URL."""
        service = OrdersService(self.db_path(name))
        if self._proc is None:
            self.tenants[name] = service
        return f"http://127.0.0.1:{self.port}/t/{name}"

    def db_path(self, name: str) -> Path:
        return self.folder / f"{name}.sqlite3"

    def stop(self) -> None:
        if self._server is None:
            proc = self._proc
            if proc is not None and proc.exitcode is None and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
                proc.join(timeout=5)
                if proc.exitcode is None:
                    self.kill()
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> TenantOrders:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
