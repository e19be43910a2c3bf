"""The run document is authenticated before anything in it is used: a worker refuses a
rewritten, forged, swapped or foreign document with an incident, and builds no adapter,
loads no agent and runs no verifier command from it. Agents load only from the worker's
own allow-list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.demo.examples import greeting_document, make_greeting_workspace
from ratchet.errors import ConfigurationError, IntegrityError, RunNotFoundError
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument, VerifierSpec, seal_document
from ratchet.leasing import run_keys
from ratchet.ops import inspect_run, submit
from ratchet.redis_server import RedisServer
from ratchet.runtime.signing import parse_envelope, seal_envelope
from ratchet.worker.job import execute_run
from tests.worker.conftest import CHECKPOINT_KEY_HEX

MakeWorkspace = Callable[..., tuple[Path, RunDocument]]


def effects(root: Path) -> int:
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        return adapter.effects


def hostile_verifier(document: RunDocument, marker: Path) -> RunDocument:
    """The document with every verifier replaced by a shell that leaves ``marker``."""
    shell = VerifierSpec(argv=("/bin/sh", "-c", f"touch {marker}; exit 0"))
    env = document.environment.model_copy(
        update={"verifiers": dict.fromkeys(document.environment.verifiers, shell)}
    )
    return document.model_copy(update={"environment": env})


def stored_document(fleet: Fleet, run_id: str) -> bytes:
    blob = fleet.store.client.get(run_keys(run_id).scenario)
    assert isinstance(blob, bytes)
    return blob


def assert_refused_and_untouched(fleet: Fleet, run_id: str, root: Path, check: str) -> None:
    before = fleet.store.read_run(run_id)
    report = execute_run(fleet, run_id, owner="w-doc")
    assert report.outcome == "restore_refused", report
    incidents = fleet.store.records.incidents(run_id)
    assert incidents[0]["kind"] == "restore_refused"
    assert incidents[0]["reason"] == "document", incidents[0]
    assert check in incidents[0]["message"] or check == "", incidents[0]
    after = fleet.store.read_run(run_id)
    assert after.generation == before.generation
    assert after.lease_version > before.lease_version  # the job took a lease, then refused
    assert not after.lease_live  # released, off the index: no retry loop
    assert effects(root) == 0


def test_a_verifier_command_rewritten_in_redis_never_runs(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    root, document = workspace()
    run_id = submit(fleet, document)
    marker = tmp_path / "verifier-ran"
    # The attacker can write Redis keys but has no checkpoint key: they rewrite the signed
    # body in place (the MAC no longer verifies) ...
    _header, body = parse_envelope(stored_document(fleet, run_id))
    data = json.loads(body)
    data["document"] = json.loads(hostile_verifier(document, marker).model_dump_json())
    tampered = stored_document(fleet, run_id).replace(
        body, json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    )
    fleet.store.client.set(run_keys(run_id).scenario, tampered)
    assert_refused_and_untouched(fleet, run_id, root, "does not verify")
    assert not marker.exists()
    # ... or store a plain, unsigned document.
    plain = hostile_verifier(document, marker).model_dump_json().encode()
    fleet.store.client.set(run_keys(run_id).scenario, plain)
    assert_refused_and_untouched(fleet, run_id, root, "does not verify")
    assert not marker.exists()


def test_a_document_signed_for_another_run_is_refused(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    root, document = workspace()
    run_id = submit(fleet, document)
    _other_root, other = workspace()
    other_id = submit(fleet, other)
    fleet.store.client.set(run_keys(run_id).scenario, stored_document(fleet, other_id))
    assert_refused_and_untouched(fleet, run_id, root, "another run")


def test_a_document_the_checkpoints_do_not_bind_is_refused(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    """Even a correctly signed document for this run id is refused when the checkpoint
    binds another one (another submission under the same id, signed by a key holder)."""
    root, document = workspace()
    run_id = submit(fleet, document)
    marker = tmp_path / "verifier-ran"
    resigned = seal_document(fleet.keyring, run_id, hostile_verifier(document, marker))
    fleet.store.client.set(run_keys(run_id).scenario, resigned)
    assert_refused_and_untouched(fleet, run_id, root, "binds another document")
    assert not marker.exists()
    with pytest.raises(IntegrityError) as err:  # show refuses to display it too
        inspect_run(fleet, run_id)
    assert err.value.reason == "document"


def test_a_checkpoint_cannot_stand_in_for_a_document(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    """Documents and checkpoints are signed under different domains: an envelope that
    verifies as one never verifies as the other."""
    root, document = workspace()
    run_id = submit(fleet, document)
    checkpoint = fleet.store.read_run(run_id, with_checkpoint=True).checkpoint
    assert checkpoint is not None
    fleet.store.client.set(run_keys(run_id).scenario, checkpoint)
    assert_refused_and_untouched(fleet, run_id, root, "does not verify")
    # The same body sealed as a checkpoint does not open as a document either.
    _header, body = parse_envelope(seal_document(fleet.keyring, run_id, document))
    fleet.store.client.set(run_keys(run_id).scenario, seal_envelope(fleet.keyring, body))
    assert_refused_and_untouched(fleet, run_id, root, "does not verify")


def test_an_agent_outside_the_workers_allow_list_is_refused_before_it_is_imported(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "agent-imported"
    monkeypatch.setenv("RATCHET_PROBE_AGENT_MARKER", str(marker))
    # A test before this one may have imported the probe already: import it afresh.
    monkeypatch.delitem(sys.modules, "tests.worker.agent_probe", raising=False)
    root, document = workspace()
    probe = document.model_copy(update={"agent": "tests.worker.agent_probe:make"})
    # A submitter whose settings allow the package creates the run (signed, bound) ...
    submitter = Fleet.connect(fleet.settings.model_copy(update={"agents": ("tests.worker",)}))
    run_id = submit(submitter, probe)
    assert marker.exists()  # the submitter resolved and built it: that is allowed there
    marker.unlink()
    sys.modules.pop("tests.worker.agent_probe", None)
    # ... but this worker does not allow it: nothing is imported or built.
    report = execute_run(fleet, run_id, owner="w-policy")
    assert report.outcome == "restore_refused"
    assert "not allowed on this worker" in fleet.store.records.incidents(run_id)[0]["message"]
    assert not marker.exists()
    assert effects(root) == 0


@pytest.mark.parametrize(
    "agent", ["subprocess:run", "os:system", "nope", "no.such.module:factory", "json:dumps"]
)
def test_submit_refuses_an_agent_no_worker_here_may_load(
    fleet: Fleet, workspace: MakeWorkspace, agent: str
) -> None:
    _root, document = workspace()
    with pytest.raises(ConfigurationError) as err:
        submit(fleet, document.model_copy(update={"agent": agent}), run_id="r-bad-agent")
    assert err.value.field == "agent"
    with pytest.raises(RunNotFoundError):
        fleet.store.read_run("r-bad-agent")


def test_an_allowed_agent_that_cannot_be_built_is_refused_at_submit(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    _root, document = workspace()
    allowing = Fleet.connect(fleet.settings.model_copy(update={"agents": ("json",)}))
    with pytest.raises(ConfigurationError, match=r"has no next_step|factory failed"):
        submit(allowing, document.model_copy(update={"agent": "json:dumps"}))


def test_the_submit_command_refuses_a_shell_agent_in_one_line(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_REDIS_URL=redis_server.url,
        RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX,
        RATCHET_QUEUE=f"q-{tmp_path.name}",
    )
    # A task file naming a shell as its agent.
    task = tmp_path / "task.json"
    doc = greeting_document(make_greeting_workspace(tmp_path / "ws2"))
    task.write_text(
        json.dumps(
            {
                "scenario": json.loads(doc.scenario.model_dump_json()),
                "environment": json.loads(doc.environment.model_dump_json()),
            }
        )
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ratchet.cli.entry",
            "submit",
            str(task),
            "--agent",
            "subprocess:run",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("ratchet: error:") and "not allowed" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
