"""What a workspace observation reuses and what it never does: the same facts give the
same observation, and any edit made outside the adapter (a second handle's included) is
seen at once; a temp file no write accounts for is swept when the adapter opens."""

from __future__ import annotations

from pathlib import Path

import pytest

from ratchet.adapters import WorkspaceAdapter
from tests.adapters.harness import RIGHT_GREETING, WRONG_GREETING, make_workspace


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_workspace(tmp_path / "ws")


def test_an_unchanged_workspace_reads_the_same_and_every_edit_moves_it_on(root: Path) -> None:
    with WorkspaceAdapter(root, ["app.py"]) as ws:
        first = ws.observe()
        assert ws.observe() == first
        (root / "app.py").write_text(RIGHT_GREETING)
        edited = ws.observe()
        assert edited.version == first.version + 1
        assert edited.fingerprint != first.fingerprint
        (root / "app.py").write_text(WRONG_GREETING)  # the first content again
        back = ws.observe()
        assert back.fingerprint == first.fingerprint
        assert back.version == edited.version + 1  # a version never names two states


def test_a_version_another_handle_moved_is_seen_by_the_next_observation(root: Path) -> None:
    with WorkspaceAdapter(root, ["app.py"]) as ws, WorkspaceAdapter(root, ["app.py"]) as other:
        first = ws.observe()
        (root / "app.py").write_text(RIGHT_GREETING)
        assert other.observe().version == first.version + 1  # the other handle notes it
        (root / "app.py").write_text(WRONG_GREETING)
        seen = ws.observe()
        assert seen.version == first.version + 2
        assert seen.fingerprint == first.fingerprint


def test_a_temp_file_no_write_accounts_for_is_swept_when_the_adapter_opens(root: Path) -> None:
    with WorkspaceAdapter(root, ["app.py"]):
        pass
    stray = root / ".ratchet" / "tmp" / "left-by-an-old-writer"
    stray.write_bytes(b"partial")
    with WorkspaceAdapter(root, ["app.py"]):
        assert not stray.exists()
