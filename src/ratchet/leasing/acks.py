"""The acknowledgement rule (``RATCHET_MIN_REPLICAS_ACK``; see ``docs/scale.md``): a
create, acquire or commit counts only once ``WAIT`` confirmed that enough replicas
received it.

``WAIT numreplicas timeout`` counts the replicas that received every write of *the
connection that sends it*, so the script and its ``WAIT`` go out together on one
connection, in one round trip (:meth:`ratchet.leasing.scripts.ScriptRunner.run_and_wait`).
A script that wrote nothing there (every commit of a retry answered ``already_applied``,
maybe on a new connection) proves nothing by its count: unconfirmed too. Part of
:class:`ratchet.leasing.store.RedisStore`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ratchet.errors import ReplicationUnconfirmedError
from ratchet.leasing.plumbing import StorePlumbing
from ratchet.leasing.scripts import ScriptName

__all__ = ["ReplicaAcks"]


class ReplicaAcks(StorePlumbing):
    """Writing scripts run with the replica rule (see the module docstring)."""

    min_replicas_ack: int  # set by RedisStore (0: the rule is off)
    replicas_ack_timeout_ms: int

    def _run_acked(
        self,
        name: ScriptName,
        keys: Sequence[str],
        args: Sequence[str | bytes | int],
        *,
        hot: bool = True,
    ) -> tuple[Any, int | None]:
        """Run a writing script; with the replica rule, ``WAIT`` on the same connection in
        the same round trip. Returns ``(reply, replicas counted or None)``."""
        if not self.min_replicas_ack:
            return self._runner.run(name, keys, args, hot=hot), None
        return self._runner.run_and_wait(
            name,
            keys,
            args,
            replicas=self.min_replicas_ack,
            timeout_ms=self.replicas_ack_timeout_ms,
        )

    def _check_acked(self, run_id: str, counted: int | None, *, wrote: bool, **ids: Any) -> None:
        """Raise ReplicationUnconfirmedError unless the rule is off, or this connection
        wrote and ``WAIT`` counted enough replicas. A call that wrote nothing (every
        commit ``already_applied``: a retry, maybe on a new connection) has a count that
        says nothing about the commit, so it is unconfirmed too."""
        if counted is None:
            return
        if wrote and counted >= self.min_replicas_ack:
            return
        raise ReplicationUnconfirmedError(
            f"{counted} of {self.min_replicas_ack} replicas confirmed the write within "
            f"{self.replicas_ack_timeout_ms} ms"
            if wrote
            else "the write was applied by an earlier call; no replica count covers it",
            run_id=run_id,
            replicas_acked=counted if wrote else 0,
            replicas_required=self.min_replicas_ack,
            **ids,
        )
