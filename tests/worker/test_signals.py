"""A SIGTERM that lands inside a finaliser still stops the process.

Python drops an exception raised in a ``__del__`` ("Exception ignored in ..."); a signal
handler that raises, run there by chance, lost its signal: a drill stopped with SIGTERM
went on and exited 1, and an idle worker (RQ raises ``StopRequested`` from its handler)
went on serving jobs. Each case runs in a child process of its own, whose handlers it may
replace, and sends the signal to itself from inside a ``__del__``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
from typing import Any

from ratchet.redis_server import RedisServer
from ratchet.worker.signals import in_finaliser

# Sends SIGTERM to this process from inside a __del__ and keeps that __del__ busy long
# enough for the handler to run there; then gives the handler 5 s to act elsewhere.
_TRIGGER = textwrap.dedent(
    """
    import gc, os, signal, time

    class Finalised:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            end = time.monotonic() + 0.2
            while time.monotonic() < end:
                pass

    def trigger():
        Finalised()
        gc.collect()
        end = time.monotonic() + 5
        while time.monotonic() < end:
            time.sleep(0.001)
    """
)


def _run(body: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _TRIGGER + textwrap.dedent(body), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_raising_handler_is_delivered_again_after_the_finaliser() -> None:
    done = _run(
        """
        from ratchet.worker.signals import outside_finalisers

        def stop(signum, frame):
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, outside_finalisers(stop))
        trigger()
        raise SystemExit(0)  # the signal was lost
        """
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "Exception ignored" not in done.stderr


def test_an_idle_worker_stops_on_a_sigterm_that_lands_in_a_finaliser(
    redis_server: RedisServer,
) -> None:
    done = _run(
        """
        import sys
        from redis import Redis
        from rq.exceptions import StopRequested
        from ratchet.worker.pool import RatchetWorker

        worker = RatchetWorker(["q"], connection=Redis.from_url(sys.argv[1]))
        worker._state = "idle"
        worker._install_signal_handlers()
        try:
            trigger()
        except StopRequested:
            raise SystemExit(0)
        raise SystemExit(1)  # the worker would have gone on after its SIGTERM
        """,
        redis_server.url,
    )
    assert done.returncode == 0, done.stderr


def test_a_frame_called_from_a_finaliser_is_inside_one() -> None:
    seen: list[bool] = []

    class Finalised:
        def __del__(self) -> None:
            seen.append(in_finaliser(sys._getframe()))

    Finalised()
    assert seen == [True]
    assert not in_finaliser(sys._getframe())


def _stop(worker: Any, stopped: threading.Event) -> None:
    worker.unsubscribe()
    stopped.set()


def test_a_worker_stops_listening_to_its_command_channel_without_hanging(
    redis_server: RedisServer,
) -> None:
    """RQ's command-channel thread, stopped at a worker's teardown, waited up to a minute
    for a subscription that never came when the stop caught it between turns (about one
    stop in five): `ratchet worker --burst` took 62 s instead of 2, and a SIGTERM'd worker
    outlived its test. Each stop here must end within a deadline far below that."""
    import time

    from redis import Redis
    from rq.serializers import JSONSerializer

    from ratchet.worker.pool import RatchetWorker

    connection = Redis.from_url(redis_server.url)
    for attempt in range(12):
        worker = RatchetWorker(
            ["q"], connection=connection, serializer=JSONSerializer, name=f"w-{attempt}"
        )
        worker.subscribe()
        time.sleep(0.05 * (attempt % 5))  # not a wait for anything: stops land at each point
        stopped = threading.Event()
        threading.Thread(target=_stop, args=(worker, stopped), daemon=True).start()
        assert stopped.wait(15), f"stop {attempt} still waiting after 15 s"
    connection.close()
