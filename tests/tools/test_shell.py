"""The shell tool: allow-listed programs in the bubblewrap sandbox (workspace read-only,
private scratch as cwd and HOME, no network unless allowed, a timeout), a receipt of exit
status and digests, and, through the engine, a command cut off before its ledger commit
that is never run again: the run waits in needs_review.

Commands count their own runs by appending to a file in a directory the test owns and
binds in read-write, so "ran once" is counted by the commands, not by the runtime.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ratchet.adapters.sandbox import Sandbox, SandboxMode
from ratchet.errors import ActionError, AdapterError, ConfigurationError
from ratchet.runtime import Action, Phase, ReviewReason, RunEngine, TraceOutcome
from ratchet.runtime.catalog import Recovery, ToolCatalog
from ratchet.tools import Toolbox, ToolCall, ToolsAdapter
from ratchet.tools.shell import MAX_ARGV, ShellArgs, ShellTool
from tests.adapters.harness import Harness, make_workspace, scenario
from tests.conftest import require_sandbox

pytestmark = pytest.mark.sandbox

EMPTY_SHA = hashlib.sha256(b"").hexdigest()
CALL = ToolCall(run_id="run-1", tool="shell", idempotency_key="k-1", fence=None)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    return make_workspace(tmp_path / "ws")


@pytest.fixture
def bwrap() -> Sandbox:
    require_sandbox()
    return Sandbox.resolve(SandboxMode.BWRAP)


def shell(workspace: Path, sandbox: Sandbox | None, **options: Any) -> ShellTool:
    programs = options.pop("programs", ["sh", sys.executable])
    return ShellTool(workspace, programs, sandbox=sandbox, **options)


def run(tool: ShellTool, *argv: str, stdin: str | None = None) -> dict[str, Any]:
    return tool.run(ShellArgs(argv=list(argv), stdin=stdin), CALL)


# -- the contract ------------------------------------------------------------------------------


def test_a_command_is_a_write_recovered_only_by_review(workspace: Path) -> None:
    tool = shell(workspace, None)
    assert tool.spec.is_write and tool.spec.name == "shell"
    assert tool.spec.recovery is Recovery.REVIEW
    assert not tool.spec.checks_fences


def test_a_program_that_is_not_allowed_is_refused_before_anything_runs(
    tmp_path: Path, workspace: Path
) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    tool = shell(workspace, None, programs=["sh"], scratch_root=scratch)
    for argv in (["rm", "-rf", str(workspace)], ["/bin/sh", "-c", "true"]):
        with pytest.raises(AdapterError, match="not allowed") as caught:
            run(tool, *argv)
        assert caught.value.retryable is False
    assert list(scratch.iterdir()) == []  # not even a scratch directory was made
    assert (workspace / "app.py").exists()


@pytest.mark.parametrize(
    ("args", "where"),
    [
        ({"argv": []}, "args.argv"),
        ({"argv": ["sh"] * (MAX_ARGV + 1)}, "args.argv"),
        ({"argv": ["sh", "x" * 5000]}, "args.argv.1"),
        ({"argv": ["sh", "a\x00b"]}, "args.argv.1"),
        ({"argv": ["sh"], "env": "x"}, "args.env"),
    ],
)
def test_arguments_out_of_bounds_are_rejected_by_the_contract(
    workspace: Path, args: dict[str, Any], where: str
) -> None:
    with pytest.raises(ActionError) as caught:
        shell(workspace, None).spec.validate_args(args)
    assert caught.value.field == where


def test_bad_constructions_are_refused(tmp_path: Path, workspace: Path) -> None:
    with pytest.raises(ConfigurationError, match="not an executable"):
        ShellTool(workspace, ["no-such-program-here"])
    with pytest.raises(ConfigurationError, match="allows no program"):
        ShellTool(workspace, [])
    with pytest.raises(ConfigurationError, match="overlaps"):
        ShellTool(workspace, ["sh"], writable=[workspace / "tests"])
    with pytest.raises(ConfigurationError, match="overlaps"):
        ShellTool(workspace, ["sh"], writable=[tmp_path])
    with pytest.raises(ConfigurationError, match="overlaps") as caught:
        ShellTool(workspace, ["sh"], scratch_root=workspace / "tests")
    assert caught.value.field == "scratch_root"
    with pytest.raises(ConfigurationError, match="bubblewrap"):
        ShellTool(workspace, ["sh"], sandbox=Sandbox.resolve(SandboxMode.NONE))


# -- in the sandbox ------------------------------------------------------------------------------


def test_an_allowed_command_runs_and_its_receipt_has_the_exit_status_and_digests(
    workspace: Path, bwrap: Sandbox
) -> None:
    out = run(shell(workspace, bwrap), "sh", "-c", "echo hi; echo oops >&2; exit 3")
    assert out["exit_status"] == 3 and out["timed_out"] is False
    assert out["stdout_sha256"] == hashlib.sha256(b"hi\n").hexdigest()
    assert out["stdout_bytes"] == 3
    assert out["stderr_sha256"] == hashlib.sha256(b"oops\n").hexdigest()
    assert out["program"].endswith("/sh")
    assert "stdout_tail" not in out  # no scrubber given: digests only


def test_the_workspace_is_read_only_but_readable(workspace: Path, bwrap: Sandbox) -> None:
    tool = shell(workspace, bwrap)
    before = (workspace / "app.py").read_bytes()
    for script in (
        'echo x > "$WORKSPACE/new.txt"',
        'echo x >> "$WORKSPACE/app.py"',
        'rm -f "$WORKSPACE/app.py"',
        'mkdir "$WORKSPACE/made"',
    ):
        out = run(tool, "sh", "-c", script)
        assert out["exit_status"] != 0, script
        assert out["stderr_bytes"] > 0
    assert sorted(p.name for p in workspace.iterdir()) == ["app.py", "tests"]
    assert (workspace / "app.py").read_bytes() == before
    read = run(tool, "sh", "-c", 'cat "$WORKSPACE/app.py"')
    assert read["exit_status"] == 0
    assert read["stdout_sha256"] == hashlib.sha256(before).hexdigest()


def test_the_workspace_state_folder_is_hidden(workspace: Path, bwrap: Sandbox) -> None:
    state = workspace / ".ratchet"
    state.mkdir()
    (state / "journal.sqlite3").write_text("the adapter's records")
    out = run(shell(workspace, bwrap), "sh", "-c", 'ls -A "$WORKSPACE/.ratchet"')
    assert out["exit_status"] == 0
    assert out["stdout_bytes"] == 0


def test_each_call_gets_a_fresh_private_scratch_as_cwd_and_home(
    tmp_path: Path, workspace: Path, bwrap: Sandbox
) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    tool = shell(workspace, bwrap, scratch_root=scratch)
    first = run(tool, "sh", "-c", 'test "$(pwd)" = "$HOME" && touch "$HOME/mark" && touch f')
    assert first["exit_status"] == 0
    again = run(tool, "sh", "-c", 'test -e "$HOME/mark" || test -e f')
    assert again["exit_status"] == 1  # the first call's files are gone
    assert list(scratch.iterdir()) == []  # and so are the scratch directories


def test_the_command_sees_a_clean_environment(
    workspace: Path, bwrap: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAYMENTS_TOKEN", "tok-from-the-worker-environment")
    tool = shell(workspace, bwrap, scrub=lambda text: text, env={"GREETING": "hello"})
    out = run(tool, "sh", "-c", "env")
    assert out["exit_status"] == 0
    assert "tok-from-the-worker-environment" not in out["stdout_tail"]
    assert "GREETING=hello" in out["stdout_tail"]
    assert f"WORKSPACE={workspace}" in out["stdout_tail"]


def test_tails_are_kept_only_scrubbed_and_bounded(workspace: Path, bwrap: Sandbox) -> None:
    tool = shell(
        workspace,
        bwrap,
        scrub=lambda text: text.replace("sk-live-hunter2", "[redacted]"),
        tail_bytes=64,
    )
    out = run(
        tool,
        "sh",
        "-c",
        "i=0; while [ $i -lt 200 ]; do echo line $i; i=$((i+1)); done; echo key=sk-live-hunter2",
    )
    assert "sk-live-hunter2" not in json.dumps(out)
    assert out["stdout_tail"].endswith("key=[redacted]\n")
    assert len(out["stdout_tail"].encode()) <= 64 and out["stdout_tail_cut"] is True
    assert out["stdout_bytes"] > 64  # the digest and count cover every byte


def test_stdin_is_fed_to_the_program(workspace: Path, bwrap: Sandbox) -> None:
    text = "hello\n" * 50_000  # larger than a pipe's buffer
    out = run(shell(workspace, bwrap), "sh", "-c", "cat", stdin=text)
    assert out["exit_status"] == 0
    assert out["stdout_sha256"] == hashlib.sha256(text.encode()).hexdigest()


def test_a_command_past_its_timeout_is_killed_and_reported(workspace: Path, bwrap: Sandbox) -> None:
    out = run(shell(workspace, bwrap, timeout_seconds=1), "sh", "-c", "echo started; sleep 60")
    assert out["timed_out"] is True and out["exit_status"] is None
    assert out["stdout_sha256"] == hashlib.sha256(b"started\n").hexdigest()


@pytest.fixture
def listener() -> Iterator[int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


def test_there_is_no_network_unless_the_tool_allows_it(
    workspace: Path, bwrap: Sandbox, listener: int
) -> None:
    connect = f"import socket; socket.create_connection(('127.0.0.1', {listener}), timeout=5)"
    closed = run(shell(workspace, bwrap), sys.executable, "-c", connect)
    assert closed["exit_status"] != 0
    opened = run(shell(workspace, bwrap, network=True), sys.executable, "-c", connect)
    assert opened["exit_status"] == 0 and opened["network"] is True


def test_a_writable_folder_the_caller_owns_keeps_what_the_command_wrote(
    tmp_path: Path, workspace: Path, bwrap: Sandbox
) -> None:
    outbox = tmp_path / "outbox"
    outbox.mkdir()
    out = run(
        shell(workspace, bwrap, writable=[outbox]), "sh", "-c", f"echo done > {outbox}/result"
    )
    assert out["exit_status"] == 0
    assert (outbox / "result").read_text() == "done\n"


# -- through the engine -----------------------------------------------------------------------


@dataclass
class ShellRun(Harness):
    catalog: ToolCatalog = field(default_factory=ToolCatalog)

    def ports(self, adapter: Any, store: Any, probe: Any = None) -> dict[str, Any]:
        return {**super().ports(adapter, store, probe), "tools": self.catalog}

    def command(self, engine: RunEngine, *argv: str, key: str = "cmd-1") -> Action:
        return Action.model_validate(
            {
                "action_id": f"a-{engine.state.next_seq}",
                "kind": "shell",
                "risk": "irreversible_external_write",
                "args": {"argv": list(argv)},
                "idempotency_key": key,
                "expected_env_version": engine.state.environment.version,
                "deadline_at": self.clock.now() + 600,
            }
        )


class CrashInTool(Exception):
    """The worker died inside the tool adapter."""


@dataclass
class Engine:
    run: ShellRun
    counter: Path
    adapters: list[ToolsAdapter]
    crash_at: list[str | None]

    def runs(self) -> int:
        return len(self.counter.read_text().splitlines()) if self.counter.exists() else 0


@pytest.fixture
def engine_setup(tmp_path: Path, workspace: Path, bwrap: Sandbox) -> Iterator[Engine]:
    counts = tmp_path / "counts"
    counts.mkdir()
    box = Toolbox([shell(workspace, bwrap, writable=[counts])])
    sc = scenario(permissions=["read_file", "finish", "shell"])
    adapters: list[ToolsAdapter] = []
    crash: list[str | None] = [None]

    def hook(stage: str) -> None:
        if stage == crash[0]:
            crash[0] = None
            raise CrashInTool(stage)

    def open_adapter() -> Any:
        adapter = box.environment(
            sc, ledger=tmp_path / "ledger.sqlite", hook=hook, clock=harness.clock
        )
        assert isinstance(adapter, ToolsAdapter)
        adapters.append(adapter)
        return adapter

    harness = ShellRun(
        open_adapter=open_adapter,
        effects=lambda: 0,
        scenario=sc,
        catalog=box.catalog,
    )
    made = Engine(harness, counts / "runs", adapters, crash)
    yield made
    for adapter in adapters:
        adapter.close()


def test_a_command_through_the_engine_commits_its_receipt(engine_setup: Engine) -> None:
    s = engine_setup
    engine = s.run.start()
    result = engine.propose(s.run.command(engine, "sh", "-c", f"echo ran >> {s.counter}; echo ok"))
    assert result.outcome is TraceOutcome.EXECUTED
    output = json.loads(str(engine.state.executed[-1].receipt.result["output"]))
    assert output["exit_status"] == 0
    assert output["stdout_sha256"] == hashlib.sha256(b"ok\n").hexdigest()
    assert s.runs() == 1


def test_a_command_cut_off_before_its_ledger_commit_is_never_run_again(
    engine_setup: Engine,
) -> None:
    """Timeline: intent committed -> ledger row started -> command ran -> [died before the
    ledger commit]. Nothing can tell whether the command ran, and running it again could
    do it twice: the resumed run waits for a reviewer, with the intent as evidence."""
    s = engine_setup
    engine = s.run.start()
    s.crash_at[0] = "after_call"
    with pytest.raises(CrashInTool):
        engine.propose(s.run.command(engine, "sh", "-c", f"echo ran >> {s.counter}"))
    assert s.runs() == 1

    resumed = s.run.resume(lease_version=2)
    resumed.reconcile()
    assert resumed.state.phase is Phase.NEEDS_REVIEW
    case = resumed.state.review
    assert case is not None and case.reason is ReviewReason.OUTCOME_UNKNOWN
    assert case.pending.action.kind == "shell"
    assert s.runs() == 1  # not run a second time
    row = s.adapters[-1].ledger.row("cmd-1")
    assert row is not None and row.status == "started" and row.attempts == 1
