"""Signal handlers that raise, made safe against finalisers.

Python runs a signal handler in the main thread at the next bytecode boundary, wherever
that is, including inside a ``__del__`` or a ``weakref.finalize`` callback that the
garbage collector happened to start (redis-py's ``ConnectionPool.__del__`` is a common
one). An exception raised there is printed as "Exception ignored in ..." and dropped, and
the signal with it: a drill stopped with SIGTERM went on running and exited 1, and RQ's
warm shutdown (whose handler raises ``StopRequested`` when the worker is idle) left a
worker running after its one SIGTERM.

:func:`outside_finalisers` wraps such a handler: called inside a finaliser, it does not
run the handler there but delivers the same signal again a moment later (through
``_thread.interrupt_main``, which calls the Python handler in the main thread), by which
time the finaliser has returned.
"""

from __future__ import annotations

import _thread
import functools
import threading
from collections.abc import Callable
from types import FrameType
from typing import Final

__all__ = ["REDELIVER_AFTER_S", "in_finaliser", "outside_finalisers"]

#: How long a signal that arrived inside a finaliser waits before it is delivered again.
REDELIVER_AFTER_S: Final = 0.01

Handler = Callable[[int, FrameType | None], None]


def in_finaliser(frame: FrameType | None) -> bool:
    """Whether ``frame`` or a frame that called it is a finaliser, where an exception is
    printed and dropped instead of propagated."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__":
            return True
        if code.co_name == "__call__" and frame.f_globals.get("__name__") == "weakref":
            return True  # weakref.finalize
        frame = frame.f_back
    return False


def outside_finalisers(handler: Handler) -> Handler:
    """``handler``, deferred (the signal delivered again) while a finaliser runs."""

    @functools.wraps(handler)
    def wrapper(signum: int, frame: FrameType | None) -> None:
        if in_finaliser(frame):
            timer = threading.Timer(REDELIVER_AFTER_S, _thread.interrupt_main, (signum,))
            timer.daemon = True
            timer.start()
            return
        handler(signum, frame)

    return wrapper
