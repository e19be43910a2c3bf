"""What a drill or a test may attach to a worker process. In production nothing is.

A worker process (``worker_main``) or a single job (``execute_run``) takes an optional
:class:`WorkerHooks`. The worker calls it at five places and knows nothing else about
faults:

* :meth:`WorkerHooks.attach`, once, when the process has connected to its store;
* :meth:`WorkerHooks.job`, when a job took a lease: the executor hooks for that job
  (:class:`ratchet.runtime.Hooks`, which see every effect the engine yields, crash windows
  included), or None;
* :meth:`WorkerHooks.renewal`, around every lease renewal of the heartbeat;
* :meth:`WorkerHooks.event`, at a job's milestones (``acquire``, ``restore``,
  ``job_end``), with the run and lease they concern;
* :meth:`WorkerHooks.write_stage`, passed to the job's workspace adapter and its declared
  tools: called at each stage of a file write (``after_intent``, ``after_replace``,
  ``after_receipt``) and of a tool call (``before_call``, ``after_call``).

The chaos harness (:mod:`ratchet.chaos.hooks`) implements it with failpoints and a drill
event log; tests implement it to crash a job at an exact window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ratchet.leasing import LeasedRun, RedisStore
from ratchet.runtime.effects import Hooks

__all__ = ["WorkerHooks"]


class WorkerHooks:
    """The default attaches nothing: each method does exactly what the worker would."""

    def attach(self, store: RedisStore) -> None:
        """The worker process connected to ``store`` (once per process)."""

    def job(self, lease: LeasedRun, lease_gone: Callable[[], bool]) -> Hooks | None:
        """The executor hooks for the job that just took ``lease`` (None: none).
        ``lease_gone()`` asks Redis whether that lease is still this job's."""
        return None

    def renewal(self, renew: Callable[[], int]) -> int:
        """Perform one lease renewal (``renew()`` returns the new expiry, Redis ms)."""
        return renew()

    def event(self, kind: str, **fields: Any) -> None:
        """A job's milestone: ``acquire``, ``restore`` or ``job_end``."""

    def write_stage(self, stage: str) -> None:
        """The job's workspace adapter reached ``stage`` of a file write: the journal
        holds the intent (``after_intent``), the file was replaced (``after_replace``),
        the receipt is written (``after_receipt``); a git workspace's commit is made
        (``before_push``) or its push landed (``after_push``); or its declared tools reached a
        call's: the ledger admitted it (``before_call``), the tool returned and nothing
        recorded it yet (``after_call``)."""
