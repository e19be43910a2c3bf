"""The acknowledgement rule (``RATCHET_MIN_REPLICAS_ACK``; see ``docs/scale.md``): a
create, acquire or commit counts only once ``WAIT`` confirmed that enough replicas
received it.

``WAIT numreplicas timeout`` counts the replicas that received every write of *the
connection that sends it*, so the script and its ``WAIT`` go out together on one
connection, in one round trip (:meth:`ratchet.leasing.scripts.ScriptRunner.run_and_wait`).
A script that wrote nothing there (every commit of a retry answered ``already_applied``,
maybe on a new connection) proves nothing by its count: unconfirmed too.

:class:`ratchet.leasing.store.RedisStore` holds one :class:`ReplicaAcks` and sends every
writing script whose acknowledgement matters through it: creates, acquires, commits and
the ledger's writes. Reads and index writes go to the script runner directly: nothing is
acknowledged by them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ratchet.errors import ReplicationUnconfirmedError
from ratchet.leasing.scripts import ScriptName, ScriptRunner

__all__ = ["ReplicaAcks"]


class ReplicaAcks:
    """Writing scripts run with the replica rule (see the module docstring), on the store's
    script runner. ``min_replicas_ack`` 0 turns the rule off: the primary's own reply
    (AOF) is the acknowledgement and :meth:`run` is the script alone."""

    def __init__(self, runner: ScriptRunner, *, min_replicas_ack: int, timeout_ms: int) -> None:
        self._runner = runner
        #: Replicas that must confirm a write (``WAIT``; 0: the rule is off).
        self.min_replicas_ack = min_replicas_ack
        #: How long ``WAIT`` waits for them.
        self.timeout_ms = timeout_ms

    def run(
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
            name, keys, args, replicas=self.min_replicas_ack, timeout_ms=self.timeout_ms
        )

    def check(self, run_id: str, counted: int | None, *, wrote: bool, **ids: Any) -> None:
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
            f"{self.timeout_ms} ms"
            if wrote
            else "the write was applied by an earlier call; no replica count covers it",
            run_id=run_id,
            replicas_acked=counted if wrote else 0,
            replicas_required=self.min_replicas_ack,
            **ids,
        )
