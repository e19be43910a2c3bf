"""The adapters' public surface is pinned: changing it is a visible decision."""

from __future__ import annotations

from pathlib import Path

import ratchet.adapters
import ratchet.testing.conformance
from ratchet.adapters import HttpAdapter, RouterAdapter, WorkspaceAdapter
from ratchet.runtime import Adapter
from ratchet.testing.memory import ManualClock, MemoryWorkspace


def test_the_adapters_public_names_are_pinned() -> None:
    assert sorted(ratchet.adapters.__all__) == sorted(
        [
            "CommandVerifier",
            "HttpAdapter",
            "RouterAdapter",
            "SystemClock",
            "VerifierCommand",
            "VerifierRun",
            "WorkspaceAdapter",
        ]
    )
    for name in ratchet.adapters.__all__:
        assert hasattr(ratchet.adapters, name)


def test_every_conformance_check_has_a_unique_name_and_a_docstring() -> None:
    names = ratchet.testing.conformance.check_names()
    assert len(names) == len(set(names))
    assert all(check.doc for check in ratchet.testing.conformance.CHECKS)


def test_the_real_adapters_satisfy_the_runtime_protocol(tmp_path: Path) -> None:
    with WorkspaceAdapter(tmp_path, ["app.py"]) as workspace:
        http = HttpAdapter("http://127.0.0.1:9")
        for adapter in (
            workspace,
            http,
            RouterAdapter(workspace, http),
            MemoryWorkspace("m", {}, clock=ManualClock()),
        ):
            assert isinstance(adapter, Adapter)
