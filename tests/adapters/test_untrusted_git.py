"""A workspace's repository is read as data: no program it configures ever runs.

``git status`` honours the repository's own ``.git/config`` (``core.fsmonitor`` runs a
program on every status; filters, hooks, ``includeIf``d files, drivers and aliases name
programs too), and code a verifier runs could write that file. ratchet never runs
``git`` on a workspace: :mod:`ratchet.adapters.gitread` reads HEAD, the index and the
objects itself. These tests plant a program in every configuration source git knows,
prove that git itself runs the planted programs (the plant has teeth), then drive every
workspace operation and find none of them ran. A parity test checks the reader against
real ``git status`` (run by the test, on repositories the test made) on the states a
workspace goes through.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet.adapters import WorkspaceAdapter
from ratchet.adapters.gitread import GitReader, blob_id
from ratchet.adapters.ground import Ground
from ratchet.adapters.sandbox import Sandbox, SandboxMode
from ratchet.adapters.verifier import CommandVerifier
from ratchet.errors import AdapterError
from ratchet.runtime import Action, Fence
from tests.adapters.harness import RIGHT_GREETING, make_workspace, run_git
from tests.planted import plant, ran, script


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


def read(path: str = "app.py") -> Action:
    return Action.model_validate(
        {
            "action_id": "r-1",
            "kind": "read_file",
            "risk": "read_only",
            "args": {"path": path},
            "expected_env_version": 0,
            "deadline_at": 2**40,
        }
    )


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, Path]:
    root = make_workspace(tmp_path / "repo", git=True)
    markers = tmp_path / "markers"
    plant(root, markers)
    return root, markers


def test_git_itself_runs_the_planted_programs(planted: tuple[Path, Path]) -> None:
    """The plant has teeth: the `git status` ratchet used to run (its environment as it
    was: no system config, HOME=/dev/null) runs the repository's fsmonitor, the file it
    includes, and the clean filter of a file whose stat changed."""
    root, markers = planted
    (root / "app.py").write_text(RIGHT_GREETING)
    env = {"PATH": os.environ["PATH"], "GIT_CONFIG_NOSYSTEM": "1", "HOME": os.devnull}
    subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain=v1", "--untracked-files=no"],
        env=env,
        capture_output=True,
        check=False,
        timeout=60,
    )
    found = ran(markers)
    assert "fsmonitor" in found or "included" in found
    assert "filter" in found


def test_no_workspace_operation_runs_any_program_the_repository_configures(
    planted: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, markers = planted
    # A `git` first on PATH that records any call: ratchet must not even start git.
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    script(fake_bin, "git-binary", markers).rename(fake_bin / "git")
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    verifier = CommandVerifier(
        {"unit": ["/bin/sh", "-c", "exit 0"]}, sandbox=Sandbox.resolve(SandboxMode.NONE)
    )
    with WorkspaceAdapter(root, ["app.py", "tests"], verifier=verifier, git=True) as ws:
        before = ws.observe()
        assert before.details["git_dirty"] == "0" and len(before.details["git_head"]) == 40
        action = write("k-1", RIGHT_GREETING, before.version)
        predicted = ws.project(action, before)
        ws.execute(
            action, action.intent_digest, Fence(run_id="r", lease_version=1, state_version=1), None
        )
        after = ws.observe()
        assert predicted == after and after.details["git_dirty"] == "1"
        assert ws.read(read()).content == RIGHT_GREETING
        assert ws.lookup("k-1") is not None
        assert ws.verify("unit").passed
    assert ran(markers) == []


def test_whether_a_workspace_is_a_repository_is_fixed_at_construction_not_by_the_disk(
    tmp_path: Path,
) -> None:
    """A folder that was not a repository stays one that is not: a `git init` and a
    planted fsmonitor behind it change no observation. A repository whose `.git` is gone
    is refused, not read as a plain folder."""
    root = make_workspace(tmp_path / "plain")
    markers = tmp_path / "markers"
    with WorkspaceAdapter(root, ["app.py"], git=False) as ws:
        before = ws.observe()
        run_git(root, "init", "-q")
        plant(root, markers)
        after = ws.observe()
        assert after == before and "git_head" not in after.details
    assert ran(markers) == []
    repo = make_workspace(tmp_path / "repo", git=True)
    with WorkspaceAdapter(repo, ["app.py"], git=True) as ws:
        ws.observe()
        (repo / ".git").rename(repo / "moved-git")
        with pytest.raises(AdapterError, match=r"no \.git folder") as caught:
            ws.observe()
        assert caught.value.reason == "git" and not caught.value.retryable


@pytest.mark.parametrize(
    ("what", "make"),
    [
        ("a .git file", lambda root: (root / ".git").write_text("gitdir: /etc\n")),
        ("reftable", lambda root: (root / ".git" / "reftable").mkdir()),
    ],
)
def test_what_the_reader_does_not_read_is_refused_by_name(
    tmp_path: Path, what: str, make: object
) -> None:
    root = make_workspace(tmp_path / "repo", git=True)
    if what == "a .git file":
        run_git(root, "status")  # it is a repository until its .git becomes a file
        import shutil

        shutil.rmtree(root / ".git")
    make(root)  # type: ignore[operator]
    with pytest.raises(AdapterError) as caught:
        GitReader(Ground(root)).status()
    assert caught.value.reason == "git"


def _git_status(root: Path) -> set[str]:
    """What git itself says (on a repository the test made, with nothing planted)."""
    out = run_git(root, "status", "--porcelain=v1", "-z", "--untracked-files=no")
    changed: set[str] = set()
    entries = out.split("\0")
    i = 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if len(entry) < 4:
            continue
        changed.add(entry[3:])
        if entry[:1] in ("R", "C"):
            i += 1
    return changed


def _head(root: Path) -> str:
    return run_git(root, "rev-parse", "--verify", "-q", "HEAD").strip() or "unborn"


def _nested(root: Path) -> None:
    (root / "deep" / "er").mkdir(parents=True)
    (root / "deep" / "er" / "x.txt").write_text("x\n")
    run_git(root, "add", "deep")


def _link(root: Path) -> None:
    (root / "link").symlink_to("app.py")
    run_git(root, "add", "link")
    run_git(root, "commit", "-qm", "link")
    (root / "link").unlink()
    (root / "link").symlink_to("elsewhere")


def _file_to_dir(root: Path) -> None:
    run_git(root, "checkout", "-q", "--", ".")
    (root / "app.py").unlink()
    (root / "app.py").mkdir()


STEPS = [
    ("clean", lambda r: None),
    ("edit a tracked file", lambda r: (r / "app.py").write_text("changed\n")),
    ("stage it", lambda r: run_git(r, "add", "app.py")),
    ("commit it", lambda r: run_git(r, "commit", "-qm", "edit")),
    ("same bytes, new mtime", lambda r: os.utime(r / "app.py", (1, 1))),
    ("delete a file", lambda r: (r / "tests" / "test_app.py").unlink()),
    ("stage the delete", lambda r: run_git(r, "rm", "-q", "--cached", "tests/test_app.py")),
    ("commit the delete", lambda r: run_git(r, "commit", "-qm", "rm")),
    ("nested new file staged", _nested),
    ("exec bit", lambda r: (r / "app.py").chmod(0o755)),
    ("commit all", lambda r: run_git(r, "commit", "-qam", "all")),
    ("a link", _link),
    ("pack everything", lambda r: run_git(r, "gc", "-q", "--prune=now")),
    ("edit after gc", lambda r: (r / "deep" / "er" / "x.txt").write_text("y\n")),
    ("a tracked file becomes a folder", _file_to_dir),
    ("detached HEAD", lambda r: run_git(r, "checkout", "-q", "--detach")),
    ("an untracked file never counts", lambda r: (r / "new.txt").write_text("n\n")),
]


def test_the_reader_agrees_with_git_status_through_a_workspace_s_life(tmp_path: Path) -> None:
    root = make_workspace(tmp_path / "repo", git=True)
    run_git(root, "config", "user.email", "t@example.com")
    run_git(root, "config", "user.name", "t")
    reader = GitReader(Ground(root))
    for name, step in STEPS:
        step(root)
        state = reader.status()
        assert state.head == _head(root), name
        assert set(state.changed) == _git_status(root), name
        assert state.dirty == bool(_git_status(root)), name


def test_an_unborn_repository_reads_as_unborn(tmp_path: Path) -> None:
    root = tmp_path / "fresh"
    root.mkdir()
    run_git(root, "init", "-q")
    (root / "a.txt").write_text("a\n")
    reader = GitReader(Ground(root))
    assert reader.status().head == "unborn" and not reader.status().dirty
    run_git(root, "add", "a.txt")
    assert reader.status().changed == frozenset({"a.txt"})
    assert reader.blobs_at("a.txt", None) == (blob_id(b"a\n"), None)


def test_a_corrupt_object_is_refused_not_trusted(tmp_path: Path) -> None:
    root = make_workspace(tmp_path / "repo", git=True)
    head = _head(root)
    loose = root / ".git" / "objects" / head[:2] / head[2:]
    loose.chmod(stat.S_IWUSR | stat.S_IRUSR)
    import zlib

    loose.write_bytes(zlib.compress(b"commit 5\x00bogus"))
    with pytest.raises(AdapterError) as caught:
        GitReader(Ground(root)).status()
    assert caught.value.reason == "git_corrupt"


def test_an_inflation_bomb_in_the_object_store_is_refused_within_the_cap(tmp_path: Path) -> None:
    """A loose object that inflates to far more than the cap is refused after inflating
    at most the cap (the process's peak memory stays bounded)."""
    root = make_workspace(tmp_path / "repo", git=True)
    head = _head(root)
    probe = f"""
import resource, sys, zlib
from pathlib import Path
root = Path({str(root)!r}); head = {head!r}
bomb = zlib.compressobj(9)
data = bomb.compress(b"commit 2000000000\\x00") + b"".join(
    bomb.compress(b"\\x00" * (1 << 20)) for _ in range(1024)) + bomb.flush()
loose = root / ".git" / "objects" / head[:2] / head[2:]
loose.chmod(0o600); loose.write_bytes(data)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
from ratchet.adapters.gitread import GitReader
from ratchet.adapters.ground import Ground
from ratchet.errors import AdapterError
try:
    GitReader(Ground(root)).status()
except AdapterError as exc:
    print(exc.reason)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out[0] == "git_corrupt"
    assert int(out[1]) < 200  # MiB above the baseline, for a 1 GiB bomb
