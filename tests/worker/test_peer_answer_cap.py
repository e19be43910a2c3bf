"""A real worker process against peers that answer 200 MiB (``ratchet.testing.flood``): an
MCP server over streamable HTTP named by the run document, and the agent's chat model.
Each answer is refused at the byte cap (``RATCHET_MAX_PEER_BYTES``) with a
``peer_answer_too_large`` incident saying which peer, the cap and the bytes seen; a
read-only tool's and the model's are refused (the job fails with the typed error), a
write's opens a review (``outcome_unknown``) and is never sent again. The measured claim:
the worker's peak memory (``VmHWM``, reset before each run) grows far less than what was
sent."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ratchet.demo.examples import greeting_document, make_greeting_workspace
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import EnvironmentSpec, McpServerSpec, RunDocument
from ratchet.fleet.settings import Settings
from ratchet.limits import DEFAULT_MAX_PEER_BYTES, max_peer_bytes, set_max_peer_bytes
from ratchet.ops import inspect_run, submit
from ratchet.runtime import Phase, ReviewReason, Scenario
from ratchet.worker.job import execute_run
from tests.tools.peer_probe import MIB, Flood
from tests.worker.fleet_harness import poll, workers

LIMIT = 3 * MIB  # not the default: the worker process takes the setting it was given
SENT = 200 * MIB
HEADROOM = 64 * MIB
DEADLINE_S = 60.0
TOOLS = ["flood_read", "flood_write", "echo"]


def _kib(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    assert found is not None, field
    return int(found.group(1))


class Runs:
    """Submits runs over one workspace folder and waits on what the worker made of them."""

    def __init__(self, fleet: Fleet, base: Path, mcp_url: str) -> None:
        self.fleet = fleet
        self.base = base
        self.mcp_url = mcp_url
        self.count = 0

    def submit(self, agent: str, config: dict[str, Any]) -> str:
        self.count += 1
        root = make_greeting_workspace(self.base / f"ws-{self.count}")
        plain = greeting_document(root, runner="python")
        scenario = Scenario.model_validate(
            {
                **plain.scenario.model_dump(mode="json"),
                "permissions": [*plain.scenario.model_dump(mode="json")["permissions"], *TOOLS],
            }
        )
        document = RunDocument(
            scenario=scenario,
            agent=agent,
            agent_config=config,
            environment=EnvironmentSpec(
                root=plain.environment.root,
                verifiers=plain.environment.verifiers,
                mcp={"flood": McpServerSpec(url=self.mcp_url)},
            ),
        )
        return submit(self.fleet, document, run_id=f"peer-{self.count}-{secrets.token_hex(3)}")

    def calling(self, tool: str) -> str:
        """A run whose agent calls ``tool`` once (a tool-calling agent, its model a script)."""
        call = {"id": "c1", "name": tool, "arguments": "{}"}
        reply = {"tool_calls": [call]}
        return self.model({"kind": "scripted", "replies": [reply]})

    def model(self, model: dict[str, Any]) -> str:
        """A run whose agent is a tool-calling agent over ``model``."""
        return self.submit("tool_calling", {"model": model, "system_prompt": "Call the tool."})

    def incident(self, run_id: str, kind: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def recorded() -> bool:
            found[:] = [i for i in self.fleet.store.records.incidents(run_id) if i["kind"] == kind]
            return bool(found)

        poll(recorded, deadline_s=DEADLINE_S, what=f"a {kind} incident of {run_id}")
        return found[0]

    def released(self, run_id: str) -> None:
        poll(
            lambda: not self.fleet.store.read_run(run_id).lease_live,
            deadline_s=DEADLINE_S,
            what=f"the lease of {run_id} released",
        )


@pytest.fixture
def capped(settings: Settings) -> Iterator[Settings]:
    # One failed job freezes a run: what a peer answers, it answers again; the tests
    # count the calls that reached it.
    yield settings.model_copy(update={"max_peer_bytes": LIMIT, "max_job_errors": 1})
    set_max_peer_bytes(DEFAULT_MAX_PEER_BYTES)  # Fleet.connect set it for this process


@pytest.mark.slow
def test_a_worker_refuses_200_mib_answers_records_why_and_its_peak_stays_flat(
    capped: Settings, tmp_path: Path
) -> None:
    fleet = Fleet.connect(capped)
    with (
        Flood(tmp_path / "mcp", "mcp-http") as mcp,
        Flood(tmp_path / "chat", "service", "--spare", "/spare") as chat,
        workers(capped) as pool,
    ):
        (worker,) = pool.start(1)
        assert worker.pid is not None
        runs = Runs(fleet, tmp_path / "runs", mcp.url())

        # Warm the worker up: an MCP call and a model call that answer small, so the
        # measures below are the runs' own (not the first imports of mcp and httpx).
        # Each ends in a job_error: the script has no second reply, the model answers 404.
        warm = runs.calling("echo")
        runs.incident(warm, "job_error")
        runs.released(warm)
        model = {"kind": "openai", "model": "m", "max_retries": 0}
        warm_model = runs.model({**model, "base_url": chat.url("/spare")})
        runs.incident(warm_model, "job_error")
        runs.released(warm_model)

        measured: dict[str, tuple[int, dict[str, Any]]] = {}
        for name, submit_run in (
            ("read", lambda: runs.calling("flood_read")),
            ("write", lambda: runs.calling("flood_write")),
            ("model", lambda: runs.model({**model, "base_url": chat.url("/v1")})),
        ):
            Path(f"/proc/{worker.pid}/clear_refs").write_text("5")  # VmHWM starts again here
            baseline = _kib(worker.pid, "VmRSS")
            run_id = submit_run()
            incident = runs.incident(run_id, "peer_answer_too_large")
            runs.released(run_id)
            growth = (_kib(worker.pid, "VmHWM") - baseline) * 1024
            measured[name] = (growth, incident | {"run_id": run_id})
        # Another job on the write's run (the server still up) sends nothing again.
        again = execute_run(fleet, measured["write"][1]["run_id"], owner="w-again")
        mcp_calls = mcp.calls()

    for name, (growth, incident) in measured.items():
        assert growth < HEADROOM, f"{name}: the worker's peak grew by {growth / MIB:.1f} MiB"
        assert incident["limit_bytes"] == LIMIT, name
        assert LIMIT < incident["seen_bytes"] <= LIMIT + (64 << 10), name
        assert incident["seen_bytes"] < SENT
    read, write, model_call = (measured[n][1] for n in ("read", "write", "model"))
    assert read["peer"] == f"MCP server ({mcp.url()})"
    assert (read["call"], read["outcome"]) == ("read", "refused")
    for refused in (read, model_call):
        incidents = fleet.store.records.incidents(refused["run_id"])
        failed = next(i for i in incidents if i["kind"] == "job_error")
        assert failed["error"] == "PeerAnswerTooLargeError"
        assert failed["next"] == "frozen: an operator acts"  # max_job_errors=1 here
    assert (write["call"], write["outcome"]) == ("execute", "outcome_unknown")
    assert model_call["peer"] == f"chat model ({chat.url('/v1')})"
    assert (model_call["call"], model_call["outcome"]) == ("model", "refused")

    state = inspect_run(fleet, write["run_id"]).state
    assert state.phase is Phase.NEEDS_REVIEW
    assert state.review is not None and state.review.reason is ReviewReason.OUTCOME_UNKNOWN
    # Each flood tool was called once: the refused read is not retried (its run is
    # frozen), the write waits for a reviewer, and the job taken after sent nothing.
    assert again.outcome == "waiting", again
    assert sorted(mcp_calls) == ["echo", "flood_read", "flood_write"]


def test_the_workers_setting_is_the_processes_cap(capped: Settings) -> None:
    Fleet.connect(capped.model_copy(update={"max_peer_bytes": 2 * MIB}))
    assert max_peer_bytes() == 2 * MIB


@pytest.mark.parametrize("value", ["65535", str((1 << 30) + 1), "lots"])
def test_a_cap_out_of_range_is_refused_by_the_settings(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RATCHET_MAX_PEER_BYTES", value)
    with pytest.raises(ValidationError) as caught:
        Settings()
    assert "max_peer_bytes" in str(caught.value)
    assert os.environ["RATCHET_MAX_PEER_BYTES"] == value
