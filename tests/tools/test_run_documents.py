"""MCP servers named by a run document: contacted only for permitted tools, sent only a
credential of the worker's own map whose destinations cover the server's URL, refused in
one line otherwise (before anything is sent); documents signed before credentials
existed still open and digest as they did."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from ratchet.errors import AdapterError, ConfigurationError
from ratchet.fleet.credentials import CredentialMap, CredentialSpec
from ratchet.fleet.runbuild import check_credentials, run_toolbox
from ratchet.fleet.runs import (
    EnvironmentSpec,
    McpServerSpec,
    RunDocument,
    VerifierSpec,
    document_digest,
)
from ratchet.tools.mcp import MCPTool
from tests.adapters.harness import make_workspace, scenario
from tests.http_recorder import Recorder
from tests.tools.conftest import Tickets

# Nothing listens here: a test that reached it would fail to connect.
NOWHERE = "http://127.0.0.1:9/mcp"
TOKEN_ENV = "TICKETS_TOKEN_FOR_TEST"
CANARY = "tickets-canary-0123456789abcdef"
PERMITTED = ["finish", "tickets_create_ticket"]


def document(
    root: Path, permissions: list[str], url: str = NOWHERE, **server: object
) -> RunDocument:
    return RunDocument(
        scenario=scenario(permissions=permissions),
        agent="greeting",
        environment=EnvironmentSpec(
            root=str(root),
            verifiers={"unit": VerifierSpec(argv=("true",))},
            mcp={"tickets": McpServerSpec(url=url, prefix="tickets_", **server)},  # type: ignore[arg-type]
        ),
    )


def tickets_map(*destinations: str) -> CredentialMap:
    return CredentialMap(
        {"tickets": CredentialSpec(env=TOKEN_ENV, destinations=destinations or (NOWHERE,))}
    )


def test_a_server_none_of_whose_tools_is_permitted_is_never_contacted(tmp_path: Path) -> None:
    box = run_toolbox(document(make_workspace(tmp_path / "ws"), ["read_file", "finish"]))
    assert len(box) == 0


def test_a_document_that_names_a_token_variable_is_refused_pointing_at_credential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, CANARY)
    doc = document(make_workspace(tmp_path / "ws"), PERMITTED, token_env=TOKEN_ENV)
    for refuse in (
        lambda: run_toolbox(doc, credentials=tickets_map()),
        lambda: check_credentials(doc, tickets_map()),
    ):
        with pytest.raises(ConfigurationError) as caught:
            refuse()
        assert caught.value.field == "environment.mcp.tickets.token_env"
        assert "no longer read" in caught.value.message and "credential" in caught.value.message
        assert "\n" not in caught.value.message and CANARY not in caught.value.message


def test_an_unset_credential_refuses_the_run_in_one_line_and_nothing_is_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with Recorder() as listener:
        url = listener.url + "/mcp"
        doc = document(make_workspace(tmp_path / "ws"), PERMITTED, url, credential="tickets")
        with pytest.raises(ConfigurationError) as caught:
            run_toolbox(doc, credentials=tickets_map(url))
        assert listener.requests == []
    assert f"${TOKEN_ENV}" in caught.value.message and "\n" not in caught.value.message


@pytest.mark.parametrize("name", ["RATCHET_REDIS_URL", "other", "tickets"])
def test_a_credential_not_defined_for_the_servers_url_is_refused_and_nothing_is_sent(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tickets`` is defined, for another URL than the one the document names."""
    monkeypatch.setenv(TOKEN_ENV, CANARY)
    with Recorder() as listener:
        doc = document(
            make_workspace(tmp_path / "ws"), PERMITTED, listener.url + "/mcp", credential=name
        )
        for credentials in (tickets_map(listener.url + "/other"), None):
            with pytest.raises(ConfigurationError) as caught:
                run_toolbox(doc, credentials=credentials)
            assert caught.value.field == "environment.mcp.tickets.credential"
            assert CANARY not in caught.value.message
        assert listener.requests == []


def test_a_mapped_credential_is_sent_to_a_real_mcp_server_that_requires_it(
    tmp_path: Path, tickets: Tickets, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = tickets.serve_http(env={"TICKETS_TOKEN": CANARY})
    root = make_workspace(tmp_path / "ws")
    monkeypatch.setenv(TOKEN_ENV, CANARY)
    with pytest.raises(AdapterError):  # no credential named: the server refuses
        run_toolbox(document(root, PERMITTED, url), credentials=tickets_map(url))
    doc = document(root, PERMITTED, url, credential="tickets")
    box = run_toolbox(doc, credentials=tickets_map(url.rsplit("/", 1)[0]))
    tool = box["tickets_create_ticket"]  # listed: the server took the bearer token
    assert isinstance(tool, MCPTool)
    tickets.adopt(tool.connection)  # closed when the test ends


def test_a_document_signed_before_credentials_existed_digests_as_it_did() -> None:
    """Its checkpoints bind this digest: computed by ratchet 0.2.0, before ``credential``
    (and ``environment.git``) existed. An unset ``credential`` stays out of the JSON."""
    doc = RunDocument.model_validate(OLD_DOCUMENT)
    assert document_digest(doc) == OLD_DIGEST
    servers = doc.model_dump(mode="json")["environment"]["mcp"]
    assert all(set(server) == {"url", "prefix", "token_env"} for server in servers.values())
    named = doc.environment.mcp["tickets"].model_copy(update={"credential": "tickets"})
    assert named.model_dump(mode="json")["credential"] == "tickets"


OLD_DIGEST = "85d618ef26dc9c161ce3cb856301d2a677e3d7a1cfad659fefd339398623b322"
OLD_DOCUMENT = {
    "agent": "tool_calling",
    "agent_config": {
        "model": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"},
        "system_prompt": "fix it",
    },
    "environment": {
        "root": "/srv/ws",
        "verifiers": {"unit": {"argv": ["python", "test_app.py"]}},
        "mcp": {
            "tickets": {"url": "http://127.0.0.1:9/mcp", "prefix": "tickets_"},
            "plain": {"url": "https://mcp.example.com/mcp"},
        },
    },
    "scenario": {
        "allowed_operations": [],
        "allowed_paths": ["app.py"],
        "allowed_verifier_targets": ["unit"],
        "approval_required": [],
        "budgets": {"cost_units": 0, "proposals": 30, "steps": 20, "wall_clock_seconds": 3600},
        "initial_files": {"app.py": 'print("Hello, wrold")\n'},
        "permissions": ["read_file", "write_file", "run_verifier", "finish"],
        "policy_id": "default",
        "policy_version": "1",
        "schema_version": 1,
        "task_id": "fix-greeting",
        "task_version": "1",
        "verifier": {"expected_files": {"app.py": 'print("Hello, world")\n'}, "target": "unit"},
    },
}


@pytest.mark.parametrize(
    "server",
    [
        {"url": "file:///etc/passwd"},
        {"url": "http://x/mcp", "prefix": "1bad"},
        {"url": "http://x/mcp", "token_env": "has space"},
        {"url": "http://x/mcp", "credential": ""},
        {"url": "http://x/mcp", "credential": 7},
        {"url": "http://x/mcp", "command": ["sh"]},  # a document never names a process
    ],
)
def test_a_bad_server_entry_is_refused_by_the_document_model(server: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        McpServerSpec.model_validate(server)
