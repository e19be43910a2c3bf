"""The ``ratchet`` command line: wiring only.

Commands::

    ratchet demo [--local] [--json]            the fleet demo (or the one-process demo)
    ratchet worker [--concurrency N] [--burst] run worker processes
    ratchet submit TASK_FILE --agent A         create and enqueue a run; prints its id
    ratchet runs [--phase P]                   list runs
    ratchet show RUN_ID                        one run: phase, budgets, pending, review, trace
    ratchet approve RUN_ID ACTION_ID --key F   sign an approval of the pending write
    ratchet review RUN_ID --decision D --key F sign a reviewer decision (replan | abort |
                                               rebaseline)
    ratchet retry RUN_ID --reason R            hand a run frozen by an outside cause back
    ratchet cancel RUN_ID --reason R [--wait S] end a run at its next safe point
    ratchet export RUN_ID [--out F]            one verifiable file of a run
    ratchet verify FILE                        check an export offline with the key ring
    ratchet purge --finished-before D          remove finished runs, leaving tombstones
    ratchet scenario check FILE                strict-load a task contract
    ratchet schema task | plan                 the JSON Schema of a task file or plan file
    ratchet keys generate --kind K --out DIR   checkpoint key file or Ed25519 key pair
    ratchet keys gen-checkpoint-key | gen-signer
    ratchet keys rotate | retire KID | revoke --role R --id ID | list
    ratchet console [--host H] [--port P]     the read-only web console
    ratchet store init                         give a new store its epoch
    ratchet redis acl --out DIR | load-scripts least-privilege Redis users
    ratchet drill [--faults F] [--seed S]      a chaos drill on real processes
    ratchet sim [--schedules N] [--seed S]     the deterministic simulator (ratchet[sim])
    ratchet dev topology replicated | cluster --dir DIR
                                               a many-server Redis on loopback, until
                                               SIGINT or SIGTERM
    ratchet version

Every command that prints a report takes ``--json`` and then prints exactly one JSON
object on stdout. A :class:`~ratchet.errors.RatchetError` becomes one line on stderr and
exit code 2, never a traceback; its message never carries key material.
"""

from __future__ import annotations

from ratchet.cli import access as _access  # noqa: F401 - registers ratchet redis ...
from ratchet.cli import console as _console  # noqa: F401 - registers ratchet console
from ratchet.cli import dev as _dev  # noqa: F401 - registers ratchet dev topology ...
from ratchet.cli import drill as _drill  # noqa: F401 - registers the drill command
from ratchet.cli import fleet as _fleet  # noqa: F401 - registers the fleet commands
from ratchet.cli import health as _health  # noqa: F401 - registers ratchet health
from ratchet.cli import hosts as _hosts  # noqa: F401 - registers ratchet attach
from ratchet.cli import keys as _keys  # noqa: F401 - registers keys rotate/retire/revoke
from ratchet.cli import local as _local  # noqa: F401 - registers the local commands
from ratchet.cli import retention as _retention  # noqa: F401 - export, verify, purge
from ratchet.cli import schema as _schema  # noqa: F401 - registers ratchet schema ...
from ratchet.cli.common import app

__all__ = ["app", "main"]


def main() -> None:
    """Console entry point (``ratchet``)."""
    app()
