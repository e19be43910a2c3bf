"""Operator operations: what a person does to runs, and what they read.

* :mod:`.operations`: submit, inspect (verified), approve, review, cancel, rebaseline, retry;
* :mod:`.retention`: export, offline verification, purge, and the retention loop a
  worker may run;
* :mod:`.diagnosis`, :mod:`.changes`, :mod:`.queueview`: why a run is where it is, the
  pending write's change, the queue and its workers;
* :mod:`.taskfile`: the task file an operator submits; :mod:`.reindex`: the phase
  indexes of runs made before them;
* :mod:`.keys`: key management (the checkpoint key file, re-signing run documents).

The worker's RQ shell (:mod:`ratchet.worker`) does not import this package; the command
line and the console do.
"""

from ratchet.ops.hosts import Attached, attach
from ratchet.ops.operations import (
    CancelPosted,
    Posted,
    RunView,
    approve,
    cancel,
    create_run,
    inspect_run,
    load_private_key,
    post_approval,
    post_review_decision,
    rebaseline,
    retry,
    review,
    review_claims,
    submit,
)

__all__ = [
    "Attached",
    "CancelPosted",
    "Posted",
    "RunView",
    "approve",
    "attach",
    "cancel",
    "create_run",
    "inspect_run",
    "load_private_key",
    "post_approval",
    "post_review_decision",
    "rebaseline",
    "retry",
    "review",
    "review_claims",
    "submit",
]
