"""Make the example's git remote: a bare repository whose ``main`` holds the files of
``workspace/`` (app.py and its test), for ``task-git.yaml``. Made with
``ratchet.adapters.gitremote.seed_bare`` (dulwich, installed with ratchet), so no ``git``
program is needed.

    python make_remote.py /tmp/ratchet-greeting.git

prints the remote's ``file://`` URL. Refuses a folder that exists.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ratchet.adapters.gitremote import seed_bare

HERE = Path(__file__).resolve().parent


def main(target: str) -> str:
    folder = Path(target).resolve()
    if folder.exists():
        raise SystemExit(f"make_remote: {folder} exists; pick a new folder")
    files = {name: (HERE / "workspace" / name).read_bytes() for name in ("app.py", "test_app.py")}
    seed_bare(
        folder,
        files,
        message=b"The example: app.py prints the wrong greeting\n",
        author=b"example <example@localhost>",
    )
    return folder.as_uri()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python make_remote.py FOLDER")
    print(main(sys.argv[1]))
