"""Runs on a git workspace, end to end through the worker: submit makes the run's branch at
its base, any host's worker continues the run (approval, a worker killed after its push),
each write is exactly one commit on the remote, and the run is bound to no host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from dulwich.repo import Repo

from ratchet.chaos.failpoints import FailpointFired
from ratchet.demo.examples import (
    RIGHT_GREETING,
    WRONG_GREETING,
    greeting_document,
    make_greeting_workspace,
)
from ratchet.errors import ConfigurationError
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import EnvironmentSpec, RunDocument
from ratchet.fleet.settings import Settings
from ratchet.ops import approve, inspect_run, submit
from ratchet.worker.hooks import WorkerHooks
from ratchet.worker.job import execute_run
from tests.gitremotes import branch_log, make_bare, writes_by_key
from tests.worker.fleet_harness import poll

pytestmark = pytest.mark.slow


def greeting_remote(tmp_path: Path) -> Path:
    """A bare repository whose ``main`` holds the example task's files."""
    files = make_greeting_workspace(tmp_path / "seed")
    bare, _ = make_bare(
        tmp_path,
        {
            "app.py": (files / "app.py").read_bytes(),
            "test_app.py": (files / "test_app.py").read_bytes(),
        },
    )
    return bare


def git_document(bare: Path, **kw: object) -> RunDocument:
    plain = greeting_document(bare, runner="python", **kw)  # type: ignore[arg-type]
    env = EnvironmentSpec(
        kind="git",
        remote={"url": f"file://{bare}", "base": "main"},
        verifiers=plain.environment.verifiers,
    )
    return plain.model_copy(update={"environment": env})


def on_host(settings: Settings, tmp_path: Path, host: str) -> Fleet:
    """A worker's fleet on another host: its own name and its own disk."""
    return Fleet.connect(
        settings.model_copy(update={"host": host, "state_dir": tmp_path / f"disk-{host}"})
    )


def file_on_branch(bare: Path, branch: str, path: str) -> bytes:
    with Repo(str(bare)) as repo:
        tree = repo.object_store[
            repo.object_store[repo.refs[b"refs/heads/" + branch.encode()]].tree
        ]
        _, sha = tree[path.encode()]
        return repo.object_store[sha].as_raw_string()


def test_a_git_run_is_submitted_with_its_branch_and_completes_with_one_commit_per_write(
    fleet: Fleet, settings: Settings, tmp_path: Path
) -> None:
    bare = greeting_remote(tmp_path)
    with Repo(str(bare)) as repo:
        main = repo.refs[b"refs/heads/main"].decode()
    run_id = submit(fleet, git_document(bare), run_id="r-git")
    view = inspect_run(fleet, run_id)
    remote = view.document.environment.remote
    assert remote is not None and remote.base == main and remote.branch == "ratchet/r-git"
    assert view.document.environment.host is None  # bound to no host
    assert fleet.store.hosts.run_host(run_id) is None
    assert [c.commit for c in branch_log(bare, "ratchet/r-git")] == [main]

    report = execute_run(on_host(settings, tmp_path, "far"), run_id, owner="w-far")
    assert report.phase == "completed", report
    assert writes_by_key(bare, "ratchet/r-git") == {
        inspect_run(fleet, run_id).state.executed[0].idempotency_key: 1
    }
    assert file_on_branch(bare, "ratchet/r-git", "app.py") == RIGHT_GREETING.encode()
    assert file_on_branch(bare, "main", "app.py") == WRONG_GREETING.encode()  # untouched
    # Nothing of the run stayed on the worker's disk but its object cache.
    leftovers = list((tmp_path / "disk-far" / "git" / "checkouts").iterdir())
    assert leftovers == []


def test_an_approved_run_continues_on_another_host(settings: Settings, tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    trust = tmp_path / "approvers.json"
    trust.write_text(
        json.dumps({"alice": key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()})
    )
    settings = settings.model_copy(update={"approvers_file": trust})
    here = on_host(settings, tmp_path, "a")
    bare = greeting_remote(tmp_path)
    run_id = submit(here, git_document(bare, approval_required=("write_file",)), run_id="r-ap")
    first = execute_run(here, run_id, owner="w-a")
    assert first.phase == "awaiting_approval", first
    pending = inspect_run(here, run_id).state.pending
    assert pending is not None
    approve(here, run_id, pending.action.action_id, key=key, approver_id="alice")
    second = execute_run(on_host(settings, tmp_path, "b"), run_id, owner="w-b")
    assert second.phase == "completed", second
    assert list(writes_by_key(bare, "ratchet/r-ap").values()) == [1]
    receipt = inspect_run(here, run_id).state.executed[-1].receipt
    assert receipt.approval_digest is not None
    assert receipt.result["commit"] == branch_log(bare, "ratchet/r-ap")[0].commit


class DieAfterThePush(WorkerHooks):
    """The worker dies right after its push landed, before anything recorded it."""

    def write_stage(self, stage: str) -> None:
        if stage == "after_push":
            raise FailpointFired("after_push")


def test_a_worker_killed_after_its_push_is_taken_over_on_another_host_without_a_second_commit(
    fleet: Fleet, settings: Settings, tmp_path: Path
) -> None:
    bare = greeting_remote(tmp_path)
    run_id = submit(fleet, git_document(bare), run_id="r-kill")
    with pytest.raises(FailpointFired):
        execute_run(on_host(settings, tmp_path, "a"), run_id, owner="w-a", hooks=DieAfterThePush())
    stored = inspect_run(fleet, run_id).state
    assert stored.pending is not None and stored.pending.receipt is None
    poll(lambda: not fleet.store.read_run(run_id).lease_live, deadline_s=30, what="expiry")
    report = execute_run(on_host(settings, tmp_path, "b"), run_id, owner="w-b")
    assert report.phase == "completed", report
    assert list(writes_by_key(bare, "ratchet/r-kill").values()) == [1]
    # The takeover's fence is on the branch: lease of a, then of b.
    fences = [
        c.trailers["Ratchet-Fence"]
        for c in branch_log(bare, "ratchet/r-kill")
        if "Ratchet-Fence" in c.trailers and "Ratchet-Key" not in c.trailers
    ]
    assert len(fences) == 2


def test_a_git_task_that_names_a_missing_base_or_a_host_is_refused_and_nothing_is_made(
    fleet: Fleet, tmp_path: Path
) -> None:
    bare = greeting_remote(tmp_path)
    document = git_document(bare)
    remote = document.environment.remote
    assert remote is not None
    missing = document.model_copy(
        update={
            "environment": document.environment.model_copy(
                update={"remote": remote.model_copy(update={"base": "no-such-branch"})}
            )
        }
    )
    with pytest.raises(ConfigurationError) as refused:
        submit(fleet, missing, run_id="r-missing")
    assert "no branch 'no-such-branch'" in str(refused.value)
    hosted = document.model_copy(
        update={"environment": document.environment.model_copy(update={"host": "h1"})}
    )
    with pytest.raises(ConfigurationError):
        submit(fleet, hosted, run_id="r-hosted")
    with Repo(str(bare)) as repo:
        refs = repo.get_refs()
    assert not [name for name in refs if name.startswith(b"refs/heads/ratchet/")]
