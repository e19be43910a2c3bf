"""Fixtures every test package can use: how verifier commands are confined here."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ratchet.adapters.sandbox import Sandbox, SandboxMode, bwrap_works

CHAOS = Path(__file__).resolve().parent / "chaos"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests of ``tests/chaos`` (whole drills and the simulator's CI budget) are
    ``drill`` tests: outside the README's test command, run by ``.ci/run`` after it
    (``pytest -m "drill and not chaos"``)."""
    for item in items:
        if item.get_closest_marker("slow") is not None and CHAOS in item.path.parents:
            item.add_marker(pytest.mark.drill)


def sandbox_available() -> bool:
    binary = shutil.which("bwrap")
    return binary is not None and bwrap_works(binary)


def test_sandbox_mode() -> SandboxMode:
    """bubblewrap where it works (CI installs it and sets RATCHET_REQUIRE_SANDBOX=1, so
    there it must); elsewhere the explicit opt-out, so the suite runs on a machine without
    it (the sandbox's own tests then skip, saying why)."""
    if sandbox_available():
        return SandboxMode.BWRAP
    if os.environ.get("RATCHET_REQUIRE_SANDBOX") == "1":
        pytest.fail("bubblewrap is required here (RATCHET_REQUIRE_SANDBOX=1) but cannot run")
    return SandboxMode.NONE


test_sandbox_mode.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def require_sandbox() -> None:
    if not sandbox_available():
        if os.environ.get("RATCHET_REQUIRE_SANDBOX") == "1":
            pytest.fail("bubblewrap is required here (RATCHET_REQUIRE_SANDBOX=1)")
        pytest.skip("the sandbox tests need Debian's bubblewrap (apt-get install bubblewrap)")


@pytest.fixture(scope="session")
def verifier_sandbox() -> Sandbox:
    return Sandbox.resolve(test_sandbox_mode())
