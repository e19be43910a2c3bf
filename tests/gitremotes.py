"""Real git servers for the git workspace's tests: a bare repository (made with dulwich, so
``file://`` needs no ``git`` program), ``git daemon`` with receive-pack on, and smart HTTP
(``git http-backend`` behind a small threaded server, with optional basic authentication).
The daemon and HTTP servers need the ``git`` program: tests that use them skip without it.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from dulwich.object_store import commit_tree_changes
from dulwich.objects import Blob, Commit
from dulwich.repo import Repo

from ratchet.adapters.gitremote import parse_trailers, seed_bare

GIT = shutil.which("git")
NO_GIT = None if GIT else "the git program is not installed (git daemon, git http-backend)"


def make_bare(
    root: Path, files: dict[str, bytes], *, branch: str = "main", name: str = "remote.git"
) -> tuple[Path, str]:
    """A bare repository at ``root/name`` whose ``branch`` holds one commit of ``files``.
    Returns the repository's folder and the commit id."""
    path = root / name
    base = seed_bare(
        path,
        files,
        branch=branch,
        message=b"base\n",
        author=b"someone <someone@example.com>",
        when=1_700_000_000,
    )
    return path, base


def push_foreign(
    bare: Path, branch: str, files: dict[str, bytes | None], *, message: bytes = b"by hand\n"
) -> str:
    """A commit made by someone else (not ratchet) on ``branch``: ``files`` changed (None
    deletes), written straight into the bare repository. Returns its id."""
    repo = Repo(str(bare))
    try:
        ref = b"refs/heads/" + branch.encode()
        parent = repo.refs[ref]
        store = repo.object_store
        changes: list[tuple[bytes, int | None, bytes | None]] = []
        for rel, data in files.items():
            if data is None:
                changes.append((rel.encode(), None, None))
                continue
            blob = Blob.from_string(data)
            store.add_object(blob)
            changes.append((rel.encode(), 0o100644, blob.id))
        tree = commit_tree_changes(store, store[store[parent].tree], changes)
        commit = Commit()
        commit.tree = tree
        commit.parents = [parent]
        commit.author = commit.committer = b"someone <someone@example.com>"
        commit.author_time = commit.commit_time = int(time.time())
        commit.author_timezone = commit.commit_timezone = 0
        commit.message = message
        store.add_object(commit)
        repo.refs[ref] = commit.id
        return commit.id.decode()
    finally:
        repo.close()


@dataclass(frozen=True)
class BranchCommit:
    commit: str
    trailers: dict[str, str]
    message: str


def branch_log(bare: Path, branch: str) -> list[BranchCommit]:
    """The first-parent history of ``branch`` in the bare repository, newest first."""
    repo = Repo(str(bare))
    try:
        at = repo.refs[b"refs/heads/" + branch.encode()]
        out = []
        while True:
            commit = repo.object_store[at]
            out.append(
                BranchCommit(at.decode(), parse_trailers(commit.message), commit.message.decode())
            )
            if not commit.parents:
                return out
            at = commit.parents[0]
    finally:
        repo.close()


def writes_by_key(bare: Path, branch: str) -> dict[str, int]:
    """How many commits on ``branch`` carry each idempotency key."""
    counts: dict[str, int] = {}
    for c in branch_log(bare, branch):
        key = c.trailers.get("Ratchet-Key")
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    return counts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], deadline_s: float = 15) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the git server exited ({proc.returncode})")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError("the git server did not listen in time")


class GitDaemon:
    """``git daemon`` serving every repository under ``base`` on loopback, receive-pack
    on. ``url(name)`` is a repository's ``git://`` URL."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> GitDaemon:
        self.proc = subprocess.Popen(
            [
                str(GIT),
                "daemon",
                "--export-all",
                "--enable=receive-pack",
                "--reuseaddr",
                f"--base-path={self.base}",
                "--listen=127.0.0.1",
                f"--port={self.port}",
                str(self.base),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**_git_env(), "HOME": str(self.base)},
            start_new_session=True,  # its children (one per connection) go with it
        )
        _wait_port(self.port, self.proc)
        return self

    def url(self, name: str = "remote.git") -> str:
        return f"git://127.0.0.1:{self.port}/{name}"

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __enter__(self) -> GitDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _git_env() -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
    }


class _CgiHandler(BaseHTTPRequestHandler):
    server: _GitHttpServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        return None

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))

    def _authorised(self) -> bool:
        wanted = self.server.auth
        if wanted is None:
            return True
        given = self.headers.get("Authorization", "")
        expected = "Basic " + base64.b64encode(f"{wanted[0]}:{wanted[1]}".encode()).decode()
        if given == expected:
            return True
        self.server.refused += 1
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="git"')
        self.send_header("Content-Length", "0")
        self.end_headers()
        return False

    def _serve(self) -> None:
        body = self._body() if self.command == "POST" else b""
        if not self._authorised():
            return
        path, _, query = self.path.partition("?")
        env = {
            **_git_env(),
            "GIT_PROJECT_ROOT": str(self.server.base),
            "GIT_HTTP_EXPORT_ALL": "1",
            "REMOTE_USER": "ratchet",
            "REQUEST_METHOD": self.command,
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "GIT_CONFIG_COUNT": "1",
            "GIT_CONFIG_KEY_0": "http.receivepack",
            "GIT_CONFIG_VALUE_0": "true",
        }
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        done = subprocess.run(
            [str(GIT), "http-backend"], input=body, env=env, capture_output=True, check=False
        )
        head, _, payload = done.stdout.partition(b"\r\n\r\n")
        if not _:
            head, _, payload = done.stdout.partition(b"\n\n")
        status = 200
        headers: list[tuple[str, str]] = []
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()


class _GitHttpServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, base: Path, auth: tuple[str, str] | None) -> None:
        super().__init__(("127.0.0.1", 0), _CgiHandler)
        self.base = base
        self.auth = auth
        self.refused = 0


class GitHttp:
    """Smart HTTP: ``git http-backend`` for every repository under ``base``, receive-pack
    on, behind basic authentication when ``auth`` (user, password) is given."""

    def __init__(self, base: Path, auth: tuple[str, str] | None = None) -> None:
        self.server = _GitHttpServer(base, auth)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def refused(self) -> int:
        return self.server.refused

    def url(self, name: str = "remote.git") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    def __enter__(self) -> GitHttp:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def served(kind: str, base: Path) -> Iterator[str]:
    """A URL prefix for repositories under ``base`` over ``kind``: ``file``, ``daemon`` or
    ``http``."""
    if kind == "file":
        yield f"file://{base}"
    elif kind == "daemon":
        with GitDaemon(base) as daemon:
            yield daemon.url("").rstrip("/")
    else:
        with GitHttp(base) as http:
            yield http.url("").rstrip("/")
