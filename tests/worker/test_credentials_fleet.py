"""Credentials are the worker's, not the task's, with real processes: ``ratchet submit``
refuses a task that names ``RATCHET_REDIS_URL`` or a name its map does not define (exit
2, one line, nothing stored, nothing sent); a ``ratchet worker`` whose map does not let a
credential go where the document says refuses the run at job start (an incident, nothing
sent: a real listener on loopback records every request); a credential mapped to its
destination reaches a real chat server and a real MCP server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ratchet.demo.examples import RIGHT_GREETING, greeting_document, make_greeting_workspace
from ratchet.demo.tools import TICKET_TOOL, scripted_turn
from ratchet.fleet.context import Fleet
from ratchet.fleet.credentials import CredentialSpec
from ratchet.fleet.runs import EnvironmentSpec, McpServerSpec, RunDocument
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run, operations, submit
from ratchet.runtime import Phase, Scenario
from ratchet.testing.chat_stub import ChatStub
from ratchet.tools import Toolbox
from ratchet.worker.job import execute_run
from tests.http_recorder import Recorder
from tests.tools.conftest import Tickets
from tests.worker.processes import RATCHET, pool_env

pytestmark = pytest.mark.slow

MODEL_ENV = "FLEET_TEST_MODEL_KEY"
TICKETS_ENV = "FLEET_TEST_TICKETS_KEY"
CANARY = "sk-worker-canary-7f3a9c0d1e2b"
SUBMITTER_CANARY = "sk-submitter-canary-55aa66bb"


def run(
    *args: str, env: dict[str, str], cwd: Path, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RATCHET, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def credentials_json(**destinations: tuple[str, str]) -> str:
    """RATCHET_CREDENTIALS: name -> (environment variable, destination)."""
    return json.dumps(
        {name: {"env": env, "destinations": [url]} for name, (env, url) in destinations.items()}
    )


def store_keys(settings: Settings) -> set[bytes]:
    fleet = Fleet.connect(settings)
    return set(fleet.store.client.scan_iter(match=b"*", count=1000))


def stored_bytes(fleet: Fleet) -> bytes:
    """Every value in the store, whatever its type, as one byte string."""
    client = fleet.store.client
    parts: list[bytes] = []
    for key in client.scan_iter(match=b"*", count=1000):
        kind = client.type(key)
        if kind == b"string":
            parts.append(client.get(key) or b"")
        elif kind == b"list":
            parts += client.lrange(key, 0, -1)
        elif kind == b"hash":
            parts += [k + v for k, v in client.hgetall(key).items()]
        elif kind == b"zset":
            parts += client.zrange(key, 0, -1)
        elif kind == b"set":
            parts += list(client.smembers(key))
        elif kind == b"stream":
            parts += [repr(entry).encode() for entry in client.xrange(key)]
    return b"\n".join(parts)


def task_file(tmp_path: Path, *, agent_config: dict[str, Any], mcp: dict[str, Any]) -> Path:
    root = make_greeting_workspace(tmp_path / "ws")
    plain = greeting_document(root, runner="python")
    scenario = plain.scenario.model_dump(mode="json")
    scenario["permissions"] = [*scenario["permissions"], TICKET_TOOL]
    task = {
        "scenario": scenario,
        "environment": {
            "root": "ws",
            "verifiers": {"unit": {"argv": [sys.executable, "test_app.py"]}},
            "mcp": mcp,
        },
        "agent_config": agent_config,
    }
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(task))
    return path


def model_config(base_url: str, **model: Any) -> dict[str, Any]:
    return {
        "model": {"kind": "openai", "base_url": base_url, "model": "stub-model", **model},
        "system_prompt": "Fix the greeting, file a ticket, run the tests.",
    }


@pytest.mark.parametrize(
    ("where", "model", "server", "field"),
    [
        ("model", {"credential": "RATCHET_REDIS_URL"}, {}, "agent_config.model.credential"),
        ("mcp", {}, {"credential": "RATCHET_REDIS_URL"}, "environment.mcp.tickets.credential"),
        ("model", {"credential": "not-defined"}, {}, "agent_config.model.credential"),
        ("mcp", {}, {"credential": "not-defined"}, "environment.mcp.tickets.credential"),
        ("model", {"api_key_env": "RATCHET_REDIS_URL"}, {}, "agent_config.model.api_key_env"),
        ("mcp", {}, {"token_env": "RATCHET_REDIS_URL"}, "environment.mcp.tickets.token_env"),
    ],
)
def test_submit_refuses_a_task_naming_a_ratchet_setting_or_an_undefined_credential(
    where: str,
    model: dict[str, Any],
    server: dict[str, Any],
    field: str,
    settings: Settings,
    tmp_path: Path,
) -> None:
    with Recorder() as listener:
        path = task_file(
            tmp_path,
            agent_config=model_config(listener.url + "/v1", **model),
            mcp={"tickets": {"url": listener.url + "/mcp", "prefix": "tickets_", **server}},
        )
        env = pool_env(settings)
        # The submitter's map defines `model`, for this very listener: the names above
        # are refused for what they are, not for where they would go.
        env.update(
            RATCHET_CREDENTIALS=credentials_json(model=(MODEL_ENV, listener.url)),
            **{MODEL_ENV: SUBMITTER_CANARY},
        )
        before = store_keys(settings)
        done = run("submit", str(path), "--agent", "tool_calling", env=env, cwd=tmp_path)
        assert done.returncode == 2, (done.stdout, done.stderr)
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("ratchet: error:"), done.stderr
        assert f"(field: {field})" in lines[0]
        assert done.stdout == ""
        assert store_keys(settings) == before  # nothing stored: no run, no queue entry
        assert listener.requests == []  # nothing sent, to the model or the server
    redis_url = env["RATCHET_REDIS_URL"]
    assert redis_url not in done.stderr and SUBMITTER_CANARY not in done.stderr
    named = model.get("credential") or server.get("credential")
    assert ("ratchet's own settings" in lines[0]) == (named == "RATCHET_REDIS_URL")
    assert ("no longer read" in lines[0]) == field.endswith("_env")


def test_a_worker_refuses_at_job_start_a_credential_its_map_does_not_send_there(
    settings: Settings, tmp_path: Path
) -> None:
    """The submitter's map lets ``model`` go to the listener; the worker's map sends it
    only elsewhere. The worker refuses the run before it builds the agent or contacts
    anything: an incident, and the listener gets no request at all."""
    with Recorder() as listener:
        root = make_greeting_workspace(tmp_path / "ws")
        document = greeting_document(root, runner="python").model_copy(
            update={
                "agent": "tool_calling",
                "agent_config": model_config(listener.url + "/v1", credential="model"),
            }
        )
        submitter = settings.model_copy(
            update={
                "credentials": {
                    "model": CredentialSpec(env=MODEL_ENV, destinations=(listener.url,))
                }
            }
        )
        fleet = Fleet.connect(submitter)
        run_id = submit(fleet, document)
        env = pool_env(settings)
        env.update(
            RATCHET_CREDENTIALS=credentials_json(model=(MODEL_ENV, "https://api.example.com/v1")),
            **{MODEL_ENV: CANARY},
        )
        worked = run("worker", "--burst", env=env, cwd=tmp_path)
        assert worked.returncode == 0, worked.stderr[-2000:]
        incidents = fleet.store.records.incidents(run_id)
        assert incidents, "the refusal is recorded for an operator"
        refusal = incidents[0]
        assert refusal["kind"] == "restore_refused", refusal
        assert "agent_config.model.credential" in refusal["message"]
        assert "may not be sent" in refusal["message"]
        snap = fleet.store.read_run(run_id)
        assert not snap.lease_live  # released, off the index: no retry loop
        assert snap.generation == 1  # nothing ran
        assert inspect_run(fleet, run_id).state.phase is Phase.RUNNING
        assert listener.requests == []
        assert listener.carrying(CANARY) == []
    assert CANARY not in worked.stderr + worked.stdout
    assert CANARY not in json.dumps(incidents)


def test_a_mapped_credential_reaches_the_real_chat_and_mcp_servers_it_is_defined_for(
    settings: Settings, tmp_path: Path
) -> None:
    """``ratchet submit`` (it lists the MCP server's tools with its own map's token) and a
    ``ratchet worker`` (model and server, with the worker's map): the chat stub refuses a
    wrong key with 401 and the tickets server any request without its token, so a
    completed run with one ticket is proof both credentials arrived; neither secret is in
    any stored byte."""
    ticket_token = "tickets-token-0a1b2c3d4e5f"
    tickets = Tickets(tmp_path / "tickets")
    try:
        mcp_url = tickets.serve_http(
            "--fences", "--idempotent", env={"TICKETS_TOKEN": ticket_token}
        )
        with ChatStub(scripted_turn, api_key=CANARY) as stub:
            path = task_file(
                tmp_path,
                agent_config=model_config(stub.base_url, credential="model"),
                mcp={"tickets": {"url": mcp_url, "prefix": "tickets_", "credential": "tickets"}},
            )
            env = pool_env(settings)
            env.update(
                RATCHET_CREDENTIALS=credentials_json(
                    model=(MODEL_ENV, stub.base_url), tickets=(TICKETS_ENV, mcp_url)
                ),
                # Stored uncompressed, so that a secret in them would be seen below.
                RATCHET_COMPRESS_CHECKPOINTS="false",
                **{MODEL_ENV: CANARY, TICKETS_ENV: ticket_token},
            )
            submitted = run("submit", str(path), "--agent", "tool_calling", env=env, cwd=tmp_path)
            assert submitted.returncode == 0, submitted.stderr
            run_id = submitted.stdout.strip()
            worked = run("worker", "--burst", env=env, cwd=tmp_path)
            assert worked.returncode == 0, worked.stderr[-2000:]
            requests = stub.requests
        fleet = Fleet.connect(settings)
        view = inspect_run(fleet, run_id)
        assert view.state.phase is Phase.COMPLETED
        assert (tmp_path / "ws" / "app.py").read_text() == RIGHT_GREETING
        assert requests and all(r.authorized for r in requests)
        assert tickets.stats().effects == 1
        stored = stored_bytes(fleet)
        assert b"tickets_create_ticket" in stored  # the scan reads the run's records
        for secret in (CANARY, ticket_token):
            assert secret.encode() not in stored
            assert secret not in view.state.model_dump_json()
            assert secret not in worked.stderr + submitted.stderr
    finally:
        tickets.close()


def test_a_stored_document_that_still_names_a_variable_is_refused_at_job_start(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run submitted before credentials existed (its document names ``token_env``)
    still opens and verifies, and a worker refuses it with an incident saying what to
    use instead. Submit today refuses such a document, so the old submit is stood in for
    by skipping the check."""
    root = make_greeting_workspace(tmp_path / "ws")
    plain = greeting_document(root, runner="python")
    document = RunDocument(
        scenario=Scenario.model_validate(plain.scenario.model_dump(mode="json")),
        agent="greeting",
        environment=EnvironmentSpec(
            root=plain.environment.root,
            verifiers=plain.environment.verifiers,
            mcp={"tickets": McpServerSpec(url="http://127.0.0.1:9/mcp", token_env="TICKETS")},
        ),
    )
    fleet = Fleet.connect(settings)
    with monkeypatch.context() as old:
        old.setattr(operations, "check_credentials", lambda document, credentials: None)
        old.setattr(operations, "run_toolbox", lambda document, **_: Toolbox())
        run_id = submit(fleet, document)
    report = execute_run(fleet, run_id, owner="w-old-document")
    assert report.outcome == "restore_refused", report
    incident = fleet.store.records.incidents(run_id)[0]
    assert incident["kind"] == "restore_refused"
    assert "environment.mcp.tickets.token_env is no longer read" in incident["message"]
