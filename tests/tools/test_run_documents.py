"""MCP servers named by a run document: contacted only for permitted tools, their token
read from the worker's environment, refused in one line when it is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from ratchet.errors import ConfigurationError
from ratchet.fleet.runs import (
    EnvironmentSpec,
    McpServerSpec,
    RunDocument,
    VerifierSpec,
    run_toolbox,
)
from tests.adapters.harness import make_workspace, scenario

# Nothing listens here: a test that reached it would fail to connect.
NOWHERE = "http://127.0.0.1:9/mcp"


def document(root: Path, permissions: list[str], **server: object) -> RunDocument:
    return RunDocument(
        scenario=scenario(permissions=permissions),
        agent="greeting",
        environment=EnvironmentSpec(
            root=str(root),
            verifiers={"unit": VerifierSpec(argv=("true",))},
            mcp={"tickets": McpServerSpec(url=NOWHERE, prefix="tickets_", **server)},  # type: ignore[arg-type]
        ),
    )


def test_a_server_none_of_whose_tools_is_permitted_is_never_contacted(tmp_path: Path) -> None:
    box = run_toolbox(document(make_workspace(tmp_path / "ws"), ["read_file", "finish"]))
    assert len(box) == 0


def test_an_unset_token_variable_refuses_the_run_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TICKETS_TOKEN_FOR_TEST", raising=False)
    doc = document(
        make_workspace(tmp_path / "ws"),
        ["finish", "tickets_create_ticket"],
        token_env="TICKETS_TOKEN_FOR_TEST",
    )
    with pytest.raises(ConfigurationError) as caught:
        run_toolbox(doc)
    assert "TICKETS_TOKEN_FOR_TEST" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "server",
    [
        {"url": "file:///etc/passwd"},
        {"url": "http://x/mcp", "prefix": "1bad"},
        {"url": "http://x/mcp", "token_env": "has space"},
        {"url": "http://x/mcp", "command": ["sh"]},  # a document never names a process
    ],
)
def test_a_bad_server_entry_is_refused_by_the_document_model(server: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        McpServerSpec.model_validate(server)
