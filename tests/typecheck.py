"""Run the type checker on a snippet of user code, for the tests that pin what a type
checker sees of ratchet's API (a decorated tool's signature, an error's typed fields):
a regression there (``Any`` again) fails no run-time test, only a user's type check."""

from __future__ import annotations

import textwrap
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[1]


def check(snippet: str, folder: Path) -> list[str]:
    """mypy's report on ``snippet`` (strict, with the project's configuration): one line
    per error and per revealed type, each starting with its line number in the snippet
    (mypy's other notes, which vary between its releases, are left out)."""
    source = folder / "snippet.py"
    source.write_text(textwrap.dedent(snippet).lstrip(), encoding="utf-8")
    out, err, _ = api.run(
        [
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(folder / "mypy-cache"),
            "--no-error-summary",
            "--hide-error-context",
            str(source),
        ]
    )
    assert not err, err
    prefix = f"{source}:"
    return [
        line.removeprefix(prefix)
        for line in out.splitlines()
        if line.startswith(prefix) and (" error: " in line or "Revealed type" in line)
    ]
