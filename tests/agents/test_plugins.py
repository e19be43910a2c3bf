"""Installed plugins are read once per import path, and a folder put on the path later is
still seen."""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from ratchet import entrypoints
from ratchet.agents import AgentPolicy


def test_the_installed_metadata_is_read_once_per_import_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def counted(**kw: Any) -> Any:
        calls.append(kw["group"])
        return metadata.entry_points(**kw)

    monkeypatch.setattr(entrypoints, "entry_points", counted)
    monkeypatch.setattr(entrypoints, "_SEEN", {})
    policy = AgentPolicy()
    for _ in range(3):
        with pytest.raises(Exception, match="neither built in nor an installed"):
            policy.resolve("no-such-agent")
    assert calls == ["ratchet.agents"]

    # A plugin in a folder put on the path afterwards is found at the next lookup.
    site = tmp_path / "site"
    info = site / "late_agent-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "late_agent.py").write_text("def make(config):\n    return config\n")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: late-agent\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[ratchet.agents]\nlate = late_agent:make\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    try:
        factory = policy.resolve("late")
        assert factory({"x": 1}) == {"x": 1}
        assert calls == ["ratchet.agents", "ratchet.agents"]
    finally:
        sys.modules.pop("late_agent", None)
