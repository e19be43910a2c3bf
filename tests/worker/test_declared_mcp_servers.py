"""Stdio MCP servers the operator declares (``RATCHET_MCP_SERVERS``) and task files name
(``environment.mcp.<name>.server``): submit starts nothing, a worker runs one server for
all its jobs and leaves nothing behind, a server that cannot start makes the job retry,
the server's live tools are pinned at the first job and a changed server stops the run,
and the server sees only the credentials its declaration gives it."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ratchet.errors import ConfigurationError, RunNotFoundError
from ratchet.fleet.context import Fleet
from ratchet.fleet.credentials import CredentialSpec
from ratchet.fleet.mcp_servers import McpServerDeclaration
from ratchet.fleet.runs import EnvironmentSpec, McpServerSpec, RunDocument, ToolCheckSpec
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run, submit
from ratchet.testing.mcp_server import stats
from ratchet.tools.mcp import close_shared, shared_count
from ratchet.worker.job import execute_run
from tests.conftest import require_sandbox
from tests.tools.procs import children
from tests.worker.fleet_harness import poll, tools_scenario

pytestmark = pytest.mark.slow

TOOLS = {"create_ticket": {}, "tickets.search": {"risk": "read_only"}}


def server_command(state: Path, pid_file: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ratchet.testing.mcp_server",
        "--state",
        str(state),
        "--pid-file",
        str(pid_file),
        *extra,
    ]


def with_servers(settings: Settings, **servers: dict[str, Any]) -> Settings:
    declared = {name: McpServerDeclaration.model_validate(d) for name, d in servers.items()}
    return settings.model_copy(update={"mcp_servers": declared})


def ticket_document(title: str = "printer on fire", ticket_id: int = 1) -> RunDocument:
    scenario = tools_scenario("file-ticket", ["tk_create_ticket", "tk_tickets_search"], "filed")
    steps = [
        {"kind": "tk_create_ticket", "args": {"title": title, "body": "third floor"}},
        {"kind": "run_verifier", "args": {"target": "filed"}},
        {"kind": "finish", "args": {"summary": "filed"}},
    ]
    check = ToolCheckSpec(
        tool="tk_tickets_search",
        arguments={"query": title},
        expect={
            "tickets": [
                {"ticket_id": ticket_id, "title": title, "body": "third floor", "status": "open"}
            ]
        },
    )
    return RunDocument(
        scenario=scenario,
        agent="scripted",
        agent_config={"steps": steps},
        environment=EnvironmentSpec(
            kind="tools",
            checks={"filed": check},
            mcp={"tickets": McpServerSpec(server="tickets", prefix="tk_")},
        ),
    )


@pytest.fixture
def shared() -> Iterator[None]:
    close_shared()
    try:
        yield
    finally:
        close_shared()


@pytest.fixture
def server_files(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "tickets", tmp_path / "server.pid"


def test_submit_starts_nothing_and_a_worker_runs_the_declared_server(
    settings: Settings, server_files: tuple[Path, Path], shared: None
) -> None:
    state, pid_file = server_files
    # The submitter's declaration names a program that does not exist on its host: submit
    # checks the declaration and never starts it.
    submitter = Fleet.connect(
        with_servers(settings, tickets={"command": ["/nonexistent/mcp-server"], "tools": TOOLS})
    )
    before = children()
    run_id = submit(submitter, ticket_document(), run_id="r-declared")
    assert children() == before and shared_count() == 0 and not pid_file.exists()
    assert submitter.store.ledger.meta(run_id).contract is None  # nothing listed yet

    worker = Fleet.connect(
        with_servers(settings, tickets={"command": server_command(state, pid_file), "tools": TOOLS})
    )
    report = execute_run(worker, run_id, owner="w-1")
    assert report.phase == "completed", [
        (e.outcome.value, e.detail, e.verifier) for e in inspect_run(worker, run_id).state.trace
    ]
    assert stats(state).effects == 1
    pinned = worker.store.ledger.meta(run_id).contract
    assert pinned is not None and pinned.startswith("env:")  # key id, HMAC, digest


def test_fifty_jobs_share_one_server_and_leave_no_process_thread_or_descriptor(
    settings: Settings, server_files: tuple[Path, Path], shared: None
) -> None:
    state, pid_file = server_files
    fleet = Fleet.connect(
        with_servers(settings, tickets={"command": server_command(state, pid_file), "tools": TOOLS})
    )
    before = children()
    counts: list[tuple[int, int]] = []
    for n in range(50):
        run_id = submit(
            fleet, ticket_document(f"ticket {n}", ticket_id=n + 1), run_id=f"r-many-{n}"
        )
        report = execute_run(fleet, run_id, owner="w-1")
        assert report.phase == "completed", report
        assert len(children() - before) == 1  # one server, whatever the job count
        counts.append((threading.active_count(), len(os.listdir("/proc/self/fd"))))
    assert stats(state).effects == 50 and shared_count() == 1
    # Steady from the fifth job on: nothing accumulates per job.
    assert counts[-1][0] <= counts[4][0]
    assert counts[-1][1] <= counts[4][1] + 2
    close_shared()
    poll(lambda: not (children() - before), deadline_s=30, what="the server to stop")


def test_a_server_that_cannot_start_retries_the_job_with_its_stderr_and_never_freezes(
    settings: Settings, server_files: tuple[Path, Path], shared: None
) -> None:
    state, pid_file = server_files
    crashing = [
        sys.executable,
        "-c",
        "import sys; sys.stderr.write('db locked: t7\\n'); sys.exit(3)",
    ]
    broken = Fleet.connect(with_servers(settings, tickets={"command": crashing, "tools": TOOLS}))
    run_id = submit(broken, ticket_document(), run_id="r-cannot-start")
    report = execute_run(broken, run_id, owner="w-1")
    assert report.outcome == "retry_later", report
    assert "db locked: t7" in report.detail
    view = inspect_run(broken, run_id)
    assert view.state.phase.value == "running"
    assert not [i for i in view.incidents if i.get("kind") == "restore_refused"]
    good = Fleet.connect(
        with_servers(settings, tickets={"command": server_command(state, pid_file), "tools": TOOLS})
    )
    poll(lambda: not good.store.read_run(run_id).lease_live, deadline_s=30, what="expiry")
    assert execute_run(good, run_id, owner="w-2").phase == "completed"
    assert stats(state).effects == 1


def test_a_server_whose_tools_changed_under_the_run_stops_it_with_the_reason(
    settings: Settings, server_files: tuple[Path, Path], shared: None
) -> None:
    state, pid_file = server_files
    first = Fleet.connect(
        with_servers(
            settings.model_copy(update={"max_steps_per_job": 1}),
            tickets={"command": server_command(state, pid_file), "tools": TOOLS},
        )
    )
    run_id = submit(first, ticket_document(), run_id="r-changed")
    assert execute_run(first, run_id, owner="w-1").steps == 1
    assert stats(state).effects == 1
    close_shared()
    # A new version of the server: create_ticket now says it is idempotent, which would
    # change how a cut-off call is recovered. The run's pin says otherwise.
    changed = Fleet.connect(
        with_servers(
            settings,
            tickets={"command": server_command(state, pid_file, "--idempotent"), "tools": TOOLS},
        )
    )
    poll(lambda: not changed.store.read_run(run_id).lease_live, deadline_s=30, what="expiry")
    report = execute_run(changed, run_id, owner="w-2")
    assert report.phase != "completed"
    assert "no longer match" in report.detail, report
    assert stats(state).effects == 1  # nothing more was sent


def test_a_forged_pin_is_refused(
    settings: Settings, server_files: tuple[Path, Path], shared: None
) -> None:
    state, pid_file = server_files
    fleet = Fleet.connect(
        with_servers(settings, tickets={"command": server_command(state, pid_file), "tools": TOOLS})
    )
    run_id = submit(fleet, ticket_document(), run_id="r-forged")
    ledger = f"ratchet:{{{run_id}}}:ledger"
    fleet.store._client.hset(ledger, "contract", "env:" + "00" * 32 + ":" + "ab" * 32)
    report = execute_run(fleet, run_id, owner="w-1")
    assert report.phase != "completed" and "not signed" in report.detail, report
    assert stats(state).effects == 0


def test_an_undeclared_server_is_refused_at_submit_and_nothing_is_stored(fleet: Fleet) -> None:
    with pytest.raises(ConfigurationError, match="does not declare") as refused:
        submit(fleet, ticket_document(), run_id="r-undeclared")
    assert "\n" not in refused.value.message
    with pytest.raises(RunNotFoundError):
        fleet.store.read_run("r-undeclared")


def test_the_server_sees_its_declared_credentials_and_nothing_of_the_worker(
    settings: Settings,
    server_files: tuple[Path, Path],
    shared: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state, pid_file = server_files
    monkeypatch.setenv("TK_TOKEN_SOURCE", "s3cret-for-tickets")
    monkeypatch.setenv("OTHER_SECRET", "s3cret-for-someone-else")
    declared = with_servers(
        settings,
        tickets={
            "command": server_command(state, pid_file),
            "env": {"TICKETS_TOKEN": "tickets"},
            "tools": TOOLS,
        },
    ).model_copy(
        update={
            "credentials": {
                "tickets": CredentialSpec(env="TK_TOKEN_SOURCE", servers=("tickets",)),
            }
        }
    )
    fleet = Fleet.connect(declared)
    run_id = submit(fleet, ticket_document(), run_id="r-env")
    assert execute_run(fleet, run_id, owner="w-1").phase == "completed"
    pid = int(pid_file.read_text())
    environ = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
        if "=" in item
    )
    assert environ["TICKETS_TOKEN"] == "s3cret-for-tickets"
    assert "OTHER_SECRET" not in environ and "TK_TOKEN_SOURCE" not in environ
    assert not [name for name in environ if name.startswith("RATCHET_")]
    seen = inspect_run(fleet, run_id)
    text = seen.state.model_dump_json() + repr(declared) + repr(declared.mcp_servers)
    assert "s3cret" not in text


def test_a_credential_is_given_only_to_the_servers_it_names(settings: Settings) -> None:
    with pytest.raises(ValidationError, match="does not define for server 'tickets'"):
        Settings(
            mcp_servers={
                "tickets": {"command": ["/bin/true"], "env": {"T": "other"}, "tools": TOOLS}
            },
            credentials={"other": {"env": "X", "destinations": ["https://api.example.com"]}},
        )


@pytest.mark.parametrize(
    ("declaration", "why"),
    [
        ({"command": ["mcp-server-git"], "tools": TOOLS}, "absolute path"),
        ({"command": ["/bin/true"], "tools": {}}, "at least 1"),
        ({"command": ["/bin/true"], "env": {"RATCHET_HOST": "c"}, "tools": TOOLS}, "RATCHET_"),
        ({"command": ["/bin/true"], "tools": {"a": {"refusal": "("}}}, "regular expression"),
        ({"command": ["/bin/true"], "tools": TOOLS, "shell": True}, "Extra"),
    ],
)
def test_a_bad_declaration_is_refused_when_settings_load(
    declaration: dict[str, Any], why: str
) -> None:
    with pytest.raises(ValidationError, match=why):
        Settings(mcp_servers={"tickets": declaration})


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ({"url": "http://127.0.0.1:1/mcp", "server": "tickets"}, "exactly one"),
        ({}, "exactly one"),
        ({"server": "tickets", "credential": "tk"}, "no credential"),
        ({"server": "bad name"}, "pattern"),
    ],
)
def test_a_document_names_a_server_by_url_or_by_declaration(spec: dict[str, Any], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        McpServerSpec.model_validate(spec)


def test_a_document_that_names_a_url_serialises_as_it_did() -> None:
    spec = McpServerSpec(url="http://127.0.0.1:1/mcp", prefix="tk_")
    assert spec.model_dump(mode="json") == {
        "url": "http://127.0.0.1:1/mcp",
        "prefix": "tk_",
        "token_env": None,
    }


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids = [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
        for kid in kids:
            found += [kid, *_descendants(kid)]
    return found


def _sandboxed(settings: Settings) -> Settings:
    source = Path(__file__).resolve().parents[2] / "src"  # an editable install's code
    return settings.model_copy(
        update={"verifier_sandbox": "bwrap", "verifier_read_only": (source,)}
    )


@pytest.mark.sandbox
def test_a_server_declared_sandboxed_writes_only_its_folder_and_keeps_secrets_off_argv(
    settings: Settings, tmp_path: Path, shared: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_sandbox()
    monkeypatch.setenv("TK_TOKEN_SOURCE", "s3cret-in-the-box")
    base = _sandboxed(settings).model_copy(
        update={
            "credentials": {"tickets": CredentialSpec(env="TK_TOKEN_SOURCE", servers=("tickets",))}
        }
    )
    home = base.state_dir / "mcp" / "tickets"
    outside = tmp_path / "outside"

    def declared(state: Path) -> Fleet:
        return Fleet.connect(
            with_servers(
                base,
                tickets={
                    "command": server_command(state, state / "pid"),
                    "env": {"TICKETS_TOKEN": "tickets"},
                    "sandbox": True,
                    "tools": TOOLS,
                },
            )
        )

    # A server that keeps its state outside its folder writes into the sandbox's own
    # /tmp, which is gone with it: nothing appears on the host.
    escaping = declared(outside)
    run_id = submit(escaping, ticket_document(), run_id="r-escaping")
    assert execute_run(escaping, run_id, owner="w-1").phase == "completed"
    close_shared()
    assert not outside.exists()

    boxed = declared(home / "db")
    run_id = submit(boxed, ticket_document(), run_id="r-boxed")
    before = children()
    assert execute_run(boxed, run_id, owner="w-2").phase == "completed"
    assert stats(home / "db").effects == 1
    (bwrap,) = children() - before  # the server's sandbox, kept for the worker's life
    assert "bwrap" in Path(f"/proc/{bwrap}/cmdline").read_text()
    for pid in [bwrap, *_descendants(bwrap)]:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"s3cret" not in cmdline
    server = _descendants(bwrap)[-1]
    environ = Path(f"/proc/{server}/environ").read_bytes().split(b"\0")
    assert b"TICKETS_TOKEN=s3cret-in-the-box" in environ
    assert not [v for v in environ if v.startswith(b"RATCHET_")]


@pytest.mark.parametrize(
    ("keys", "why"),
    [
        ({"carry": "message"}, "both carry and tool"),
        ({"git_trailer": {"repo_path": "/r"}, "carry": "m", "tool": "t"}, "or one of"),
        ({"git_trailer": {"nope": 1}}, "unexpected keyword"),
        ({"sql_key_column": {"table": "no; DROP"}}, "plain SQL name"),
    ],
)
def test_a_bad_key_recipe_is_refused_when_settings_load(keys: dict[str, Any], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        Settings(mcp_servers={"t": {"command": ["/bin/true"], "tools": {"a": {"keys": keys}}}})


def test_a_shipped_recipe_is_named_in_settings() -> None:
    declared = McpServerDeclaration.model_validate(
        {"command": ["/bin/true"], "tools": {"w": {"keys": {"sql_key_column": {"table": "t"}}}}}
    )
    recipe = declared.tools["w"].keys
    assert recipe is not None
    made = recipe.made()
    assert (made.carry, made.tool, made.placeholder, made.quote) == (
        "query",
        "read_query",
        ":ratchet_key",
        "sql",
    )
