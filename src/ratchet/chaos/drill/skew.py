"""Skewed clocks in a drill: worker processes whose wall clock is shifted.

A worker's wall clock gates nothing that matters (leases expire on Redis' clock, approval
expiry is judged on an upper bound of it), and a worker refuses to start beyond
``RATCHET_MAX_CLOCK_SKEW_MS`` (2 s by default). The ``clock-skew`` fault holds the fleet
to both: some workers start with their clock shifted within the bound
(:data:`WORKER_SKEWS_S`) and do ordinary work, one starts :data:`FAR_OFF_S` off and must
exit 2 without ever taking a lease.

The shift is a ``sitecustomize`` module on ``PYTHONPATH`` that replaces ``time.time`` in
every interpreter the worker starts: the process' own view of the wall clock, nothing
else (the monotonic clock, which a lease's local bound uses, is left alone, as a real
host's is). Only one ``sitecustomize`` is imported per interpreter, so a skewed worker
does not also load one a caller put on ``PYTHONPATH`` before the drill.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

__all__ = ["FAR_OFF_S", "WORKER_SKEWS_S", "skew_env", "unskew"]

#: Shifts handed to the first workers of a clock-skew drill, in turn (within a 2 s bound).
WORKER_SKEWS_S = (1.5, -1.5, 1.0, -1.0)
#: The one worker that must refuse to start.
FAR_OFF_S = -7200.0


def skew_env(folder: Path, seconds: float) -> dict[str, str]:
    """The environment of a process whose ``time.time`` is ``seconds`` off: a folder of its
    own in ``folder`` holding the ``sitecustomize``, first on ``PYTHONPATH``."""
    name = f"skew{'p' if seconds >= 0 else 'm'}{abs(round(seconds * 1000))}ms"
    site = folder / "skew" / name
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(f"""\
        # Shifts this interpreter's wall clock by a fixed offset (a drill's skewed host).
        import time

        _real = time.time
        time.time = lambda: _real() + ({float(seconds)!r})
        """)
    )
    rest = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.fspath(site) + (os.pathsep + rest if rest else "")}


def unskew(at: float, skew_s: float) -> float:
    """A time a skewed process logged, on the drill's own clock."""
    return at - skew_s
