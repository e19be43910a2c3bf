"""The git workspace against real git servers: fencing at the remote (a zombie's push and
two writers racing), pushes whose reply was lost (landed or not), drift and rewrites,
checkouts that refuse unsafe trees, credentials, and no ``git`` program ever started.

The conformance suite (``test_conformance.py``) runs the adapter contract over
``file://``, ``git daemon`` and smart HTTP; this file drives the interleavings."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dulwich.objects import Blob, Commit, Tree
from dulwich.repo import Repo

from ratchet.adapters.gitremote import RemoteBranch, parse_trailers
from ratchet.adapters.gitworkspace import GitWorkspaceAdapter
from ratchet.adapters.sandbox import Sandbox
from ratchet.adapters.verifier import CommandVerifier, VerifierCommand
from ratchet.errors import AdapterError, FenceRejectedError, UntrustedGroundError
from ratchet.fleet.credentials import CredentialMap, CredentialSpec
from ratchet.fleet.runbuild import remote_branch
from ratchet.fleet.runs import EnvironmentSpec
from ratchet.runtime import Action, Fence
from ratchet.testing.memory import ManualClock
from tests.conftest import test_sandbox_mode
from tests.gitremotes import (
    NO_GIT,
    GitDaemon,
    GitHttp,
    branch_log,
    make_bare,
    push_foreign,
    writes_by_key,
)

needs_git = pytest.mark.skipif(NO_GIT is not None, reason=str(NO_GIT))
BRANCH = "ratchet/r1"


def write(key: str, content: str, expected: int, path: str = "app.py") -> Action:
    return Action.model_validate(
        {
            "action_id": f"a-{key}",
            "kind": "write_file",
            "risk": "reversible_write",
            "args": {"path": path, "content": content},
            "idempotency_key": key,
            "expected_env_version": expected,
            "deadline_at": 2**40,
        }
    )


def verifier_for(argv: tuple[str, ...]) -> CommandVerifier:
    """A verifier of target ``unit``, confined as the suite confines (bwrap where it
    runs; the explicit opt-out on a machine without it)."""
    return CommandVerifier(
        {"unit": VerifierCommand(argv=argv)}, sandbox=Sandbox.resolve(test_sandbox_mode())
    )


def fence(lease: int, state: int = 1) -> Fence:
    return Fence(run_id="r1", lease_version=lease, state_version=state)


class Remote:
    """One bare repository with the run's branch at its base, and handles on it."""

    def __init__(self, root: Path, url_of: Callable[[str], str]) -> None:
        self.root = root
        self.bare, self.base = make_bare(root, {"app.py": b"old\n", "test_app.py": b"ok\n"})
        with Repo(str(self.bare)) as repo:
            repo.refs[b"refs/heads/" + BRANCH.encode()] = self.base.encode()
        self.url = url_of(self.bare.name)
        self.handles: list[GitWorkspaceAdapter] = []

    def handle(self, url: str | None = None, **kw: object) -> GitWorkspaceAdapter:
        n = len(self.handles)
        remote = RemoteBranch(url or self.url, BRANCH, cache=self.root / f"cache-{n}")
        adapter = GitWorkspaceAdapter(
            remote,
            base=self.base,
            run_id="r1",
            allowed_paths=["app.py"],
            scratch=self.root / f"scratch-{n}",
            clock=ManualClock(1_800_000_000),
            **kw,  # type: ignore[arg-type]
        )
        self.handles.append(adapter)
        return adapter

    def writes(self) -> dict[str, int]:
        return writes_by_key(self.bare, BRANCH)

    def close(self) -> None:
        for handle in self.handles:
            handle.close()


@pytest.fixture(params=["file", "daemon"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    if request.param == "file":
        made = Remote(tmp_path, lambda name: f"file://{tmp_path}/{name}")
        yield made
        made.close()
        return
    if NO_GIT is not None:
        pytest.skip(NO_GIT)
    with GitDaemon(tmp_path) as daemon:
        made = Remote(tmp_path, daemon.url)
        yield made
        made.close()


def test_a_write_is_one_commit_whose_trailers_are_the_receipt(remote: Remote) -> None:
    ws = remote.handle()
    ws.raise_fence(fence(1))
    before = ws.observe()
    receipt = ws.execute(write("k1", "new\n", before.version), "a" * 64, fence(1), "b" * 64)
    log = branch_log(remote.bare, BRANCH)
    # base, the fence commit of lease 1, the write.
    assert [c.trailers.get("Ratchet-Key") for c in log] == ["k1", None, None]
    head = log[0].trailers
    assert head["Ratchet-Intent"] == "a" * 64 and head["Ratchet-Approval"] == "b" * 64
    assert head["Ratchet-Fence"] == "1.1" and head["Ratchet-Path"] == "app.py"
    assert receipt.result["commit"] == log[0].commit
    assert receipt.env_version_after == ws.observe().version == before.version + 1
    # Another worker (its own cache, as on another host) reads the same receipt.
    assert remote.handle().lookup("k1") == receipt
    # The fence commit changed no file and counts in no version.
    assert log[1].trailers["Ratchet-Fence"] == "1.1" and "Ratchet-Key" not in log[1].trailers


def test_a_zombie_s_push_fails_at_the_remote_once_a_new_owner_raised_its_fence(
    remote: Remote,
) -> None:
    """The zombie checked the fences of the tip it read and built its commit on it; the
    new owner's fence commit lands first; the zombie's compare-and-swap fails at the
    remote, and a retry is refused by its own fence check. Nothing of it lands."""
    new_owner = remote.handle()
    seen: list[str] = []

    def new_owner_takes_over(stage: str) -> None:
        seen.append(stage)
        if stage == "before_push":
            new_owner.raise_fence(fence(2))

    zombie = remote.handle(hook=new_owner_takes_over)
    zombie.raise_fence(fence(1))
    version = zombie.observe().version
    with pytest.raises(AdapterError) as lost:
        zombie.execute(write("k1", "zombie\n", version), "a" * 64, fence(1), None)
    assert lost.value.reason == "branch_moved" and lost.value.retryable
    assert seen == ["before_push"]
    with pytest.raises(FenceRejectedError):
        zombie.execute(write("k1", "zombie\n", version), "a" * 64, fence(1), None)
    assert remote.writes() == {}
    # "Absent" is final for the new owner: it writes the key once.
    assert new_owner.lookup("k1") is None
    new_owner.execute(write("k1", "owner\n", version), "a" * 64, fence(2), None)
    assert remote.writes() == {"k1": 1}


def test_two_writers_racing_on_one_branch_land_one_commit(remote: Remote) -> None:
    first = remote.handle()
    second = remote.handle()
    version = first.observe().version

    def other_lands_first(stage: str) -> None:
        if stage == "before_push":
            second.execute(write("k2", "second\n", version), "b" * 64, fence(1), None)

    racer = remote.handle(hook=other_lands_first)
    with pytest.raises(AdapterError) as lost:
        racer.execute(write("k1", "first\n", version), "a" * 64, fence(1), None)
    assert lost.value.reason == "branch_moved"
    assert remote.writes() == {"k2": 1}
    # Its precondition no longer holds: the retry is refused, not written on top.
    with pytest.raises(AdapterError) as stale:
        first.execute(write("k1", "first\n", version), "a" * 64, fence(1), None)
    assert stale.value.retryable is False
    assert remote.writes() == {"k2": 1}


def test_a_foreign_push_is_drift_and_a_rewritten_branch_is_refused(remote: Remote) -> None:
    ws = remote.handle()
    before = ws.observe()
    push_foreign(remote.bare, BRANCH, {"app.py": b"by hand\n"})
    after = ws.observe()
    assert after.instance_id == before.instance_id and not after.same_state(before)
    assert after.version == before.version + 1
    # History rewritten past the base: nothing is observed or written.
    with Repo(str(remote.bare)) as repo:
        orphan = Commit()
        orphan.tree = repo.object_store[repo.refs[b"refs/heads/main"]].tree
        orphan.author = orphan.committer = b"x <x@example.com>"
        orphan.author_time = orphan.commit_time = 1_700_000_001
        orphan.author_timezone = orphan.commit_timezone = 0
        orphan.message = b"rewritten\n"
        repo.object_store.add_object(orphan)
        repo.refs[b"refs/heads/" + BRANCH.encode()] = orphan.id
    with pytest.raises(AdapterError) as rewritten:
        ws.observe()
    assert rewritten.value.reason == "branch_rewritten"
    with Repo(str(remote.bare)) as repo:
        del repo.refs[b"refs/heads/" + BRANCH.encode()]
    with pytest.raises(AdapterError) as gone:
        ws.observe()
    assert gone.value.reason == "branch_missing"


class CuttingProxy:
    """A TCP proxy to a git daemon that loses the reply of the next push: ``landed``
    forwards the push and waits for the server to finish before it cuts the client off
    (the update happened, the client never hears so); ``lost`` cuts both sides as soon
    as the client starts sending its commands (nothing reaches the server)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.mode = "pass"
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(client,), daemon=True).start()

    def _session(self, client: socket.socket) -> None:
        server = socket.create_connection(("127.0.0.1", self.target))
        mode = self.mode
        first = client.recv(65536)  # the request line: which service
        server.sendall(first)
        pushing = b"git-receive-pack" in first and mode != "pass"
        phase = {"client_spoke": False}

        def down() -> None:  # server -> client
            while True:
                try:
                    data = server.recv(65536)
                except OSError:
                    break
                if not data:
                    break
                if pushing and phase["client_spoke"]:
                    continue  # the report: swallowed (landed: wait for the end)
                with contextlib.suppress(OSError):
                    client.sendall(data)
            if pushing:
                self.cut.set()
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)
                client.close()

        reader = threading.Thread(target=down, daemon=True)
        reader.start()
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                break
            if not data:
                break
            if pushing:
                phase["client_spoke"] = True
                if mode == "lost":
                    self.cut.set()
                    for sock in (client, server):
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                    break
            with contextlib.suppress(OSError):
                server.sendall(data)
        if not pushing:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_WR)
        reader.join(timeout=10)
        server.close()
        client.close()

    def url(self, name: str) -> str:
        return f"git://127.0.0.1:{self.port}/{name}"

    def close(self) -> None:
        self.listener.close()


@needs_git
@pytest.mark.parametrize("mode", ["landed", "lost"])
def test_a_push_whose_reply_was_lost_is_looked_up_never_committed_twice(
    tmp_path: Path, mode: str
) -> None:
    with GitDaemon(tmp_path) as daemon:
        proxy = CuttingProxy(daemon.port)
        made = Remote(tmp_path, proxy.url)
        try:
            ws = made.handle()
            ws.raise_fence(fence(1))
            version = ws.observe().version
            proxy.mode = mode
            action = write("k1", "new\n", version)
            if mode == "landed":
                proxy.mode = "landed"
                receipt = ws.execute(action, "a" * 64, fence(1), None)
                assert proxy.cut.is_set()  # the reply really was lost
                assert made.writes() == {"k1": 1}
                proxy.mode = "pass"
                assert receipt == made.handle().lookup("k1")
            else:
                with pytest.raises(AdapterError) as unknown:
                    ws.execute(action, "a" * 64, fence(1), None)
                assert unknown.value.context["outcome"] == "unknown"
                assert proxy.cut.is_set() and made.writes() == {}
                proxy.mode = "pass"
                # The engine's next step: behind a (new) fence, look the key up.
                settle = made.handle()
                settle.raise_fence(fence(2))
                assert settle.lookup("k1") is None
                settle.execute(action, "a" * 64, fence(2), None)
                assert made.writes() == {"k1": 1}
        finally:
            proxy.close()
            made.close()


def _tree_with(repo: Repo, entries: list[tuple[bytes, int, bytes]]) -> bytes:
    tree = Tree()
    for name, mode, sha in entries:
        tree.add(name, mode, sha)
    repo.object_store.add_object(tree)
    return tree.id


@pytest.mark.parametrize("bad", [b".git", b".GIT", b".."])
def test_a_checkout_refuses_a_tree_entry_it_may_not_create(tmp_path: Path, bad: bytes) -> None:
    made = Remote(tmp_path, lambda name: f"file://{tmp_path}/{name}")
    with Repo(str(made.bare)) as repo:
        hook = Blob.from_string(b"#!/bin/sh\ntouch /tmp/owned\n")
        repo.object_store.add_object(hook)
        inner = _tree_with(repo, [(b"config", 0o100644, hook.id)])
        app = Blob.from_string(b"x\n")
        repo.object_store.add_object(app)
        top = _tree_with(repo, [(b"app.py", 0o100644, app.id), (bad, 0o040000, inner)])
        commit = Commit()
        commit.tree = top
        commit.parents = [made.base.encode()]
        commit.author = commit.committer = b"x <x@example.com>"
        commit.author_time = commit.commit_time = 1_700_000_002
        commit.author_timezone = commit.commit_timezone = 0
        commit.message = b"planted\n"
        repo.object_store.add_object(commit)
        repo.refs[b"refs/heads/" + BRANCH.encode()] = commit.id
    verifier = verifier_for((sys.executable, "-c", "0"))
    ws = made.handle(verifier=verifier)
    with pytest.raises(UntrustedGroundError) as refused:
        ws.verify("unit")
    assert refused.value.reason == "unsafe_name"
    assert not (tmp_path / "config").exists() and not (tmp_path.parent / "config").exists()
    made.close()


@pytest.mark.sandbox
def test_the_verifier_runs_on_a_checkout_of_the_branch_and_is_bound_to_it(
    tmp_path: Path,
) -> None:
    made = Remote(tmp_path, lambda name: f"file://{tmp_path}/{name}")
    argv = (sys.executable, "-c", "import sys; sys.exit(open('app.py').read() != 'new\\n')")
    ws = made.handle(verifier=verifier_for(argv))
    assert not ws.verify("unit").passed
    version = ws.observe().version
    ws.execute(write("k1", "new\n", version), "a" * 64, fence(1), None)
    report = ws.verify("unit")
    assert report.passed and report.env_version == version + 1
    checkout = ws.root
    mode = stat.S_IMODE((checkout / "app.py").stat().st_mode)
    assert mode == 0o644 and not (checkout / ".git").exists()
    ws.close()
    assert not checkout.exists()  # thrown away after the job


def test_no_git_program_runs_for_any_operation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "git-ran"
    fake = bin_dir / "git"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    made = Remote(tmp_path / "r", lambda name: f"file://{tmp_path}/r/{name}")
    verifier = verifier_for((sys.executable, "-c", "0"))
    ws = made.handle(verifier=verifier)
    ws.raise_fence(fence(1))
    version = ws.observe().version
    ws.execute(write("k1", "new\n", version), "a" * 64, fence(1), None)
    ws.lookup("k1")
    ws.verify("unit")
    made.close()
    assert not marker.exists()


@needs_git
def test_an_http_remote_gets_the_worker_s_credential_and_nothing_leaks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "s3cret-" + "x" * 20
    monkeypatch.setenv("GIT_TOKEN_FOR_TEST", secret)
    bare, base = make_bare(tmp_path, {"app.py": b"old\n"})
    with Repo(str(bare)) as repo:
        repo.refs[b"refs/heads/" + BRANCH.encode()] = base.encode()
    with GitHttp(tmp_path, auth=("ratchet", secret)) as http:
        url = http.url(bare.name)
        credentials = CredentialMap(
            {"git": CredentialSpec(env="GIT_TOKEN_FOR_TEST", destinations=(url,))}
        )
        env = EnvironmentSpec(
            kind="git", remote={"url": url, "base": base, "branch": BRANCH, "credential": "git"}
        )
        branch = remote_branch(
            env, state_dir=tmp_path / "st", credentials=credentials, branch=BRANCH
        )
        assert branch.tip() == base.encode()
        assert secret not in repr(branch)
        # Without the credential the server refuses, and the error names no secret.
        bare_env = env.model_copy(
            update={"remote": env.remote.model_copy(update={"credential": None})}
        )  # type: ignore[union-attr]
        anonymous = remote_branch(
            bare_env, state_dir=tmp_path / "st2", credentials=None, branch=BRANCH
        )
        with pytest.raises(AdapterError) as refused:
            anonymous.tip()
        assert refused.value.retryable is False
        assert secret not in str(refused.value) and http.refused >= 1
        branch.close()
        anonymous.close()


def test_trailers_are_read_only_from_the_last_paragraph() -> None:
    message = (
        b"subject\n\nRatchet-Key: no\n\n"
        b"body\nRatchet-Key: k1\nRatchet-Fence: 1.2\nRatchet-Bad: a b\n"
    )
    assert parse_trailers(message) == {"Ratchet-Key": "k1", "Ratchet-Fence": "1.2"}
    assert parse_trailers(b"Ratchet-Key: k1\n") == {}
