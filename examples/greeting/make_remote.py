"""Make the example's git remote: a bare repository whose ``main`` holds the files of
``workspace/`` (app.py and its test), for ``task-git.yaml``. Uses dulwich (installed with
ratchet), so no ``git`` program is needed.

    python make_remote.py /tmp/ratchet-greeting.git

prints the remote's ``file://`` URL. Refuses a folder that exists.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from dulwich.object_store import commit_tree_changes
from dulwich.objects import Blob, Commit, Tree
from dulwich.repo import Repo

HERE = Path(__file__).resolve().parent


def main(target: str) -> str:
    folder = Path(target).resolve()
    if folder.exists():
        raise SystemExit(f"make_remote: {folder} exists; pick a new folder")
    folder.mkdir(parents=True)
    repo = Repo.init_bare(str(folder))
    try:
        store = repo.object_store
        changes = []
        for name in ("app.py", "test_app.py"):
            blob = Blob.from_string((HERE / "workspace" / name).read_bytes())
            store.add_object(blob)
            changes.append((name.encode(), 0o100644, blob.id))
        empty = Tree()
        store.add_object(empty)
        commit = Commit()
        commit.tree = commit_tree_changes(store, empty, changes)
        commit.author = commit.committer = b"example <example@localhost>"
        commit.author_time = commit.commit_time = int(time.time())
        commit.author_timezone = commit.commit_timezone = 0
        commit.message = b"The example: app.py prints the wrong greeting\n"
        store.add_object(commit)
        repo.refs[b"refs/heads/main"] = commit.id
    finally:
        repo.close()
    return folder.as_uri()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python make_remote.py FOLDER")
    print(main(sys.argv[1]))
