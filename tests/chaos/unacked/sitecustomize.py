"""A deliberately broken build, made by the drill's self-test only: with this folder first
on ``PYTHONPATH``, every Python process the drill starts (its workers included) takes a
commit as acknowledged whatever ``WAIT`` counted, so the acknowledgement rule is set but
not kept. The product has no switch for this; the break lives here, in the test."""

from __future__ import annotations

from typing import Any

from ratchet.leasing.acks import ReplicaAcks


def _trusting(self: Any, run_id: str, counted: Any, *, wrote: bool, **ids: Any) -> None:
    return None


ReplicaAcks.check = _trusting  # type: ignore[method-assign]
