"""A deliberately broken build, made by the drill's self-test only: with this folder first
on ``PYTHONPATH``, every Python process the drill starts (its workers included) loads a
workspace journal that accepts stale fences, so a zombie's late write lands. The product
has no switch for this; the break lives here, in the test."""

from __future__ import annotations

from typing import Any

from ratchet.adapters import journal


def _accepts_every_fence(self: Any, fence: Any) -> bool:
    row = self._db.execute(
        "SELECT lease_version, state_version FROM fences WHERE run_id = ?", (fence.run_id,)
    ).fetchone()
    if row is not None and fence.key() < (int(row[0]), int(row[1])):
        return True  # a stale fence, accepted and not recorded: no fence at all
    return _checked(self, fence)


_checked = journal.Journal._check_fence
journal.Journal._check_fence = _accepts_every_fence  # type: ignore[method-assign]
