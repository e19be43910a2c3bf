"""Tests share helpers through helper modules, never by importing another test module (a
test module's import runs its fixtures' and markers' side effects, and couples two files
that should change apart)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def test_no_test_module_imports_another_test_module() -> None:
    offenders = [
        f"{path.relative_to(TESTS)} imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for name in _imported_modules(path)
        if name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")
    ]
    assert offenders == []


def test_the_check_sees_such_an_import(tmp_path: Path) -> None:
    sample = tmp_path / "test_sample.py"
    sample.write_text("from tests.runtime.test_review import frozen\n")
    assert _imported_modules(sample) == ["tests.runtime.test_review"]


SRC = TESTS.parent / "src" / "ratchet"


def test_the_test_tree_mirrors_the_packages() -> None:
    """Each test folder is named after the package it tests; ``project`` holds the checks
    of the repository as a whole."""
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in TESTS.iterdir() if (p / "__init__.py").exists()}
    assert folders - {"project"} <= packages, sorted(folders - packages)
