"""The YAML, JSON, Python and TOML code blocks of the documentation, for the tests that load
or run them (task files and plans through the real parsers, a tool package's code and
entry points installed as shown), so a page cannot show what ratchet refuses.

A block says what it is with a comment line in it (YAML only; a JSON block is taken by
its keys):

    # docs-test: fragment                  part of a task file: the test completes it
    # docs-test: name=mcp-task             a name another block or test refers to
    # docs-test: task=mcp-task             a plan file, loaded with that task file
    # docs-test: agent=tool_calling        loaded (and its agent built) under this agent
    # docs-test: skip                      not a task or plan file, whatever its keys
    # docs-test: fragment (why, in words)  words in parentheses end the markers

Without a marker a block whose top-level keys are a task file's (``scenario``,
``scenario_file``, ``environment``, ``agent_config``, or a misspelling the parser would
refuse beside them, such as ``agent``) is a whole task file; one with ``steps`` (or a list
of steps) is a plan file; a block with a scenario's fields is a scenario fragment and
needs ``fragment``. Any other block (a credentials map, a wire message) is not loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MARK", "Block", "blocks", "named"]

ROOT = Path(__file__).resolve().parents[1]
MARK = "docs-test:"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>yaml|yml|json|python|toml)[ \t]*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text (the fence's indentation
    removed) and the markers its ``# docs-test:`` lines set."""

    path: Path
    line: int
    lang: str
    text: str
    marks: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _marks(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in text.splitlines():
        head, sep, rest = line.strip().partition(MARK)
        if not sep or head.strip() != "#":
            continue
        for word in rest.split():
            if word.startswith("("):
                break  # the rest of the line says why, for the reader
            key, _, value = word.partition("=")
            found[key] = value
    return found


def blocks(path: Path) -> list[Block]:
    """Every YAML, JSON, Python or TOML fenced block of the Markdown file at ``path``, in
    order (``yml`` is read as ``yaml``)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opened = _FENCE.match(lines[index])
        if opened is None:
            index += 1
            continue
        indent = opened.group("indent")
        body: list[str] = []
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            body.append(lines[end].removeprefix(indent))
            end += 1
        text = "\n".join(body) + "\n"
        lang = "yaml" if opened.group("lang") == "yml" else opened.group("lang")
        found.append(Block(path, index + 1, lang, text, _marks(text)))
        index = end + 1
    return found


def named(path: Path, name: str) -> Block:
    """The block of ``path`` marked ``name=<name>``.

    Raises:
        LookupError: there is none, or more than one.
    """
    hits = [b for b in blocks(path) if b.marks.get("name") == name]
    if len(hits) != 1:
        raise LookupError(f"{path.relative_to(ROOT)} has {len(hits)} blocks named {name!r}")
    return hits[0]
