"""Worker processes: an RQ ``SimpleWorker`` per process, plus a reaper thread.

``SimpleWorker`` runs each job in the worker process itself (no fork per job: RQ's forking
worker costs about 10 ms per job), so a SIGKILL of the worker is a SIGKILL of the job, and
ratchet's lease expiry plus the reaper recover the run.

Signals: the first SIGTERM (or SIGINT) sets :data:`ratchet.worker.job.STOP`; the running
job finishes its current step, which is committed, releases the lease for reaping and
returns; RQ then stops the worker (warm shutdown). A second SIGTERM is RQ's cold shutdown;
the lease then expires and another worker's reaper hands the run on.

:func:`run_pool` starts N such processes (spawned, each in its own process group),
forwards SIGTERM/SIGINT to them, and replaces one that dies while the pool is not
stopping: one log line (pid, exit code or signal, deaths so far), then a new process with
the same index after a backoff (:class:`RestartPolicy`: doubling from
``worker_restart_backoff_ms`` up to ``worker_restart_backoff_max_ms``, reset once a
process lived :data:`STABLE_AFTER_MS`). :data:`CRASH_LOOP_DEATHS` deaths in a row of one
slot's processes, each soon after its start, are a crash loop: the pool says so, stops
the others and exits :data:`EXIT_CRASH_LOOP`.

RQ's own ``rq.worker_pool.WorkerPool`` does not fit: it forks (ratchet spawns, so no
thread, lock or Redis connection of the parent is inherited), each child runs RQ's fixed
``run_worker`` (no per-process fleet, clock and eviction checks, hooks, metrics port
or reaper thread), it respawns at once with no backoff, no death log and no crash-loop
limit, and it checks its children once a second instead of waiting on them. Overriding
all of that would leave nothing of it but the name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any, Final, Protocol

from rq import SimpleWorker
from rq.serializers import JSONSerializer

from ratchet.errors import ConfigurationError
from ratchet.fleet import logs, metrics
from ratchet.fleet.clock import check_clock_skew
from ratchet.fleet.context import Fleet
from ratchet.fleet.identity import owner_id
from ratchet.fleet.settings import Settings
from ratchet.worker import job
from ratchet.worker.hooks import WorkerHooks
from ratchet.worker.reaper import Reaper
from ratchet.worker.signals import outside_finalisers

__all__ = [
    "CRASH_LOOP_DEATHS",
    "EXIT_CRASH_LOOP",
    "PUBSUB_TURN_S",
    "STABLE_AFTER_MS",
    "RatchetWorker",
    "RestartPolicy",
    "describe_exit",
    "run_pool",
    "worker_main",
]

log = logging.getLogger("ratchet.worker.pool")

#: How long RQ's command-channel thread waits per turn (and so at most at a stop).
PUBSUB_TURN_S: Final = 1.0
#: ``ratchet worker``'s exit code when it gave up on a crash loop.
EXIT_CRASH_LOOP: Final = 3
#: A worker process that lived this long was healthy (its slot's count of deaths that came
#: too soon starts again).
STABLE_AFTER_MS: Final = 60_000
#: This many deaths in a row of one slot's processes, each sooner than STABLE_AFTER_MS
#: after its start, are a crash loop.
CRASH_LOOP_DEATHS: Final = 5


class RatchetWorker(SimpleWorker):
    """RQ's in-process worker, with JSON jobs and a graceful stop between steps."""

    def handle_warm_shutdown_request(self) -> None:
        job.STOP.set()
        super().handle_warm_shutdown_request()  # type: ignore[no-untyped-call]

    def subscribe(self) -> None:
        # RQ's command channel (a kill-horse or shutdown command), read by a thread that
        # waits up to ``sleep_time`` per turn. After the unsubscribe at teardown it waits
        # that long for a subscription that never comes, and redis-py (8.x) joins it
        # without a bound: with RQ's 60 s every stop (a burst's end, a SIGTERM) could hang
        # for a minute. One second per turn bounds the stop at about that.
        self.log.info("subscribing to channel %s", self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(  # type: ignore[assignment]
            sleep_time=PUBSUB_TURN_S,
            daemon=True,
            exception_handler=self._pubsub_exception_handler,
        )

    def _install_signal_handlers(self) -> None:
        # RQ's handler raises StopRequested when the worker is idle; raised inside a
        # finaliser it would be dropped and the worker would go on after its SIGTERM.
        stop = outside_finalisers(self.request_stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)


class Stoppable(Protocol):
    """A background service a worker process runs beside its RQ worker."""

    def stop(self) -> None:
        """Stop the service (called once, when the worker stops)."""


def worker_main(
    settings_json: str,
    index: int,
    burst: bool = False,
    *,
    own_process_group: bool = False,
    hooks_factory: Callable[[], WorkerHooks | None] | None = None,
    background: Callable[[Fleet], Stoppable | None] | None = None,
) -> None:
    """Entry point of one worker process.

    ``background`` (a module-level function, so that it reaches a spawned process) starts
    a service beside the worker once the fleet is connected, stopped when the worker
    stops; ``ratchet worker`` passes the retention loop
    (:func:`ratchet.ops.retention.start_retention`), which the worker's RQ shell does not
    import itself.

    ``hooks_factory`` (drills and tests only; a module-level function, so that it reaches a
    spawned process) builds the process's hooks (:mod:`ratchet.worker.hooks`).

    ``own_process_group`` (the pool's processes): a terminal's Ctrl+C reaches only the
    pool, which forwards it once; in the terminal's group each process would get it twice,
    and a second SIGINT is RQ's cold shutdown.
    """
    if own_process_group:
        os.setpgid(0, 0)
    # Text by default, JSON lines with RATCHET_LOG_FORMAT=json; level RATCHET_LOG_LEVEL.
    logs.configure_logging(stream=sys.stderr)
    settings = Settings.model_validate_json(settings_json)
    # The embedded server (no RATCHET_REDIS_URL) is started again if it is gone.
    fleet = Fleet.connect(settings, start_embedded=True)
    hooks = hooks_factory() if hooks_factory is not None else None
    if hooks is not None:
        hooks.attach(fleet.store)
    job.configure(fleet, hooks)
    owner = owner_id(settings.worker_name)
    logs.set_worker_id(owner)  # the lease owner id of this process
    sandbox = fleet.sandbox
    (log.info if sandbox.confined else log.warning)(sandbox.describe())
    try:
        fleet.check_eviction_policy()
        skew = measure_clock_skew(fleet)
    except ConfigurationError as exc:
        log.error("refusing to start", extra={"reason": exc.message})
        raise SystemExit(2) from None
    log.info("clock skew to the store", extra={"outcome": f"{skew:+.3f} s"})
    metrics.serve_metrics(index)  # RATCHET_METRICS_PORT + index, if set
    # A claim older than the pickup deadline whose run no worker took means the job that
    # claim enqueued was lost: another reaper may claim the run again.
    # This host is alive from now on (each reaper tick says so again): runs bound to it
    # are handed to its queue, which this worker serves before the shared one.
    fleet.store.hosts.note(settings.host)
    reaper = Reaper(
        fleet.store,
        fleet.enqueue,
        interval_ms=settings.reaper_interval_ms,
        reclaim_after_ms=settings.pickup_timeout_ms,
        host=settings.host,
        host_timeout_ms=settings.host_timeout_ms,
    ).start()
    service = background(fleet) if background is not None else None
    worker = RatchetWorker(
        fleet.served_queues(),
        connection=fleet.rq_connection,
        serializer=JSONSerializer,
        name=f"{owner}-{index}",
    )
    try:
        worker.work(burst=burst, with_scheduler=False, logging_level="WARNING")
    finally:
        reaper.stop()
        if service is not None:
            service.stop()
        # Stdio MCP servers the jobs' tool packages shared (ratchet.tools.mcp.shared) stop
        # with the worker; the module is looked up, not imported (the mcp extra is
        # optional and a worker that never used it has nothing to close).
        shared = sys.modules.get("ratchet.tools.mcp.shared")
        if shared is not None:
            shared.close_shared()


def _settings_json(settings: Settings) -> str:
    # Secrets travel to the child processes through this JSON (never through argv or logs).
    data: dict[str, Any] = settings.model_dump(mode="json")
    for name in ("redis_url", "checkpoint_key", "http_token"):
        secret = getattr(settings, name)
        data[name] = secret.get_secret_value() if secret is not None else None
    return json.dumps(data)


def measure_clock_skew(fleet: Fleet) -> float:
    """This host's wall clock minus Redis' (seconds), set on the ``ratchet_clock_skew_seconds``
    gauge. Raises ConfigurationError beyond ``max_clock_skew_ms``."""
    # The wall clock is what is measured here (against Redis'); nothing gates on it.
    sent = time.time()
    store_ms = fleet.store.server_time_ms()
    received = time.time()
    try:
        skew = check_clock_skew(
            store_ms,
            sent_at_wall=sent,
            received_at_wall=received,
            max_skew_ms=fleet.settings.max_clock_skew_ms,
        )
    except ConfigurationError:
        metrics.CLOCK_SKEW.set(((sent + received) / 2 * 1000 - store_ms) / 1000)
        raise
    metrics.CLOCK_SKEW.set(skew)
    return skew


@dataclass(frozen=True)
class RestartPolicy:
    """When a slot's next worker process starts after one died. Pure: times are arguments.

    A process that lived at least ``stable_after_ms`` was healthy: its death is answered
    after ``base_ms``. Deaths sooner than that count up per slot: the replacement waits
    ``base_ms`` doubled per earlier such death, at most ``cap_ms``; the
    ``crash_loop_deaths``-th in a row is a crash loop, and the pool gives up.
    """

    base_ms: int
    cap_ms: int
    stable_after_ms: int = STABLE_AFTER_MS
    crash_loop_deaths: int = CRASH_LOOP_DEATHS

    @classmethod
    def from_settings(cls, settings: Settings) -> RestartPolicy:
        return cls(
            base_ms=settings.worker_restart_backoff_ms,
            cap_ms=settings.worker_restart_backoff_max_ms,
        )

    def after_death(self, quick_deaths: int, lived_ms: int) -> tuple[int, int | None]:
        """The slot's new count of deaths in a row that came too soon, and the delay
        before its replacement in ms (None: a crash loop, give up)."""
        if lived_ms >= self.stable_after_ms:
            return 0, self.base_ms
        quick = quick_deaths + 1
        if quick >= self.crash_loop_deaths:
            return quick, None
        return quick, min(self.cap_ms, self.base_ms * 2 ** (quick - 1))


def describe_exit(exitcode: int | None) -> str:
    """``exit code 2`` or ``killed by SIGKILL`` (multiprocessing's negative exit codes)."""
    if exitcode is None:
        return "running"
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"killed by signal {-exitcode}"


def _duration(ms: int) -> str:
    return f"{ms} ms" if ms < 1000 else f"{ms / 1000:g} s"


def _shell_code(exitcode: int | None) -> int:
    if exitcode is None:
        return 0
    return 128 - exitcode if exitcode < 0 else exitcode


@dataclass
class _Slot:
    index: int  # the worker process index (its metrics port offset), kept by replacements
    proc: BaseProcess | None = None
    started: float = 0.0  # monotonic seconds
    quick_deaths: int = 0
    restart_at: float | None = None  # monotonic seconds; None: no replacement pending
    exitcode: int | None = None  # of the process the pool's own shutdown stopped


def _who(pid: int, slot: _Slot) -> str:
    if pid:
        return f"worker process {pid} (slot {slot.index})"
    return f"the worker process of slot {slot.index}"


class _Supervisor:
    """Starts the worker processes, replaces those that die, stops them on SIGTERM."""

    def __init__(
        self,
        payload: str,
        *,
        concurrency: int,
        burst: bool,
        policy: RestartPolicy,
        background: Callable[[Fleet], Stoppable | None] | None = None,
    ) -> None:
        self._ctx = mp.get_context("spawn")
        self._payload = payload
        self._burst = burst
        self._background = background
        self._policy = policy
        self._slots = [_Slot(i) for i in range(concurrency)]
        self._signals: list[int] = []
        self._stopping = False
        self._gave_up = False
        self.deaths = 0
        # The signal handler only records the signal and wakes the loop through this pipe;
        # everything else happens in the loop, so no process starts behind a SIGTERM.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signals.append(signum)
        with contextlib.suppress(OSError):  # a full pipe already wakes the loop
            os.write(self._wake_w, b"\0")

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            for slot in self._slots:
                self._start(slot)
            while self._step():
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._send(signal.SIGTERM)  # only if the loop itself failed: none is alive
            os.close(self._wake_r)
            os.close(self._wake_w)
        if self._gave_up:
            return EXIT_CRASH_LOOP
        return max((_shell_code(slot.exitcode) for slot in self._slots), default=0)

    def _step(self) -> bool:
        """One turn of the loop. Returns False once every process has ended for good."""
        self._handle_signals()
        self._reap()
        self._handle_signals()  # one may have arrived meanwhile: no start behind it
        now = time.monotonic()
        for slot in self._slots:
            if slot.restart_at is None or slot.restart_at > now or self._stopping:
                continue
            try:
                self._start(slot)
            except OSError as exc:  # no process could be made (EAGAIN, ENOMEM): a death
                slot.restart_at = None
                self._died(
                    slot, 0, f"could not start: {exc.strerror or type(exc).__name__}", lived_ms=0
                )
                continue
            log.info(
                f"worker process {self._pid(slot)} (slot {slot.index}) started in "
                "place of the one that died"
            )
        alive = [slot.proc for slot in self._slots if slot.proc is not None]
        pending = [slot.restart_at for slot in self._slots if slot.restart_at is not None]
        if not alive and (self._stopping or not pending):
            return False
        timeout = max(0.0, min(pending) - time.monotonic()) if pending else None
        mp_connection.wait([proc.sentinel for proc in alive] + [self._wake_r], timeout)
        with contextlib.suppress(OSError):
            os.read(self._wake_r, 64)
        return True

    def _start(self, slot: _Slot) -> None:
        proc = self._ctx.Process(
            target=worker_main,
            args=(self._payload, slot.index, self._burst),
            kwargs={"own_process_group": True, "background": self._background},
            daemon=False,
        )
        proc.start()
        slot.proc, slot.started, slot.restart_at = proc, time.monotonic(), None

    @staticmethod
    def _pid(slot: _Slot) -> int:
        return slot.proc.pid if slot.proc is not None and slot.proc.pid is not None else 0

    def _handle_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            name = signal.Signals(signum).name
            if not self._stopping:
                self._stopping = True
                alive = sum(slot.proc is not None for slot in self._slots)
                log.info(
                    f"{name}: stopping; each of the {alive} running worker processes "
                    "finishes its current step, none is replaced",
                    extra={"cause": name},
                )
            else:
                log.warning(f"{name} again: worker processes stop at once", extra={"cause": name})
            for slot in self._slots:
                slot.restart_at = None
            self._send(signum)

    def _send(self, signum: int) -> None:
        for slot in self._slots:
            proc = slot.proc
            if proc is not None and proc.pid is not None and proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    def _reap(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            proc = slot.proc
            if proc is None or proc.is_alive():
                continue
            proc.join()
            pid, code = self._pid(slot), proc.exitcode
            slot.proc = None
            proc.close()
            cause = describe_exit(code)
            if self._stopping:
                slot.exitcode = code
                log.info(
                    f"worker process {pid} (slot {slot.index}) stopped: {cause}",
                    extra={"cause": cause},
                )
                continue
            if self._burst and code == 0:
                continue  # the queue was empty: nothing is left for this slot to do
            self._died(slot, pid, cause, lived_ms=int((now - slot.started) * 1000))
            if self._gave_up:
                return

    def _died(self, slot: _Slot, pid: int, cause: str, *, lived_ms: int) -> None:
        self.deaths += 1
        slot.quick_deaths, delay_ms = self._policy.after_death(slot.quick_deaths, lived_ms)
        if delay_ms is None:
            self._give_up(slot, pid, cause)
            return
        slot.restart_at = time.monotonic() + delay_ms / 1000
        log.warning(
            f"{_who(pid, slot)} died: {cause} (death {self.deaths} of this pool); "
            f"a new one starts in {_duration(delay_ms)}",
            extra={"cause": cause},
        )

    def _give_up(self, slot: _Slot, pid: int, cause: str) -> None:
        # A crash loop: every replacement dies as it starts (a store that refuses it, a
        # port taken, a broken install). Restarting faster helps nobody; the pool drains
        # the processes still alive and exits EXIT_CRASH_LOOP for its supervisor to see.
        self._gave_up = True
        self._stopping = True
        for other in self._slots:
            other.restart_at = None
        log.error(
            f"giving up: {_who(pid, slot)} died: {cause} "
            f"(death {self.deaths} of this pool); the last {slot.quick_deaths} "
            f"processes of slot {slot.index} each died within "
            f"{_duration(self._policy.stable_after_ms)} of their start: a crash "
            f"loop; stopping the others, exit code {EXIT_CRASH_LOOP}",
            extra={"cause": cause, "reason": "crash_loop"},
        )
        self._send(signal.SIGTERM)


def run_pool(
    settings: Settings,
    *,
    concurrency: int,
    burst: bool = False,
    background: Callable[[Fleet], Stoppable | None] | None = None,
) -> int:
    """Run ``concurrency`` worker processes until SIGTERM (or, with ``burst``, until the
    queue is empty). Returns the exit code: 0 after a clean stop, a stopped process's
    non-zero code otherwise (128 + N for signal N), :data:`EXIT_CRASH_LOOP` after giving
    up on a crash loop. ``background`` is started in each process (see
    :func:`worker_main`).

    A worker process that dies while the pool is not stopping is logged and replaced after
    a backoff (:class:`RestartPolicy`), keeping its index. The first SIGTERM (or SIGINT)
    is forwarded: each process finishes its current step and exits, and none is replaced;
    a second one is forwarded too (RQ's cold shutdown).

    Raises ConfigurationError before anything starts when this host's clock is too far
    from Redis' (see :mod:`ratchet.fleet.clock`) or the verifier sandbox asked for
    cannot work here.
    """
    logs.configure_logging(stream=sys.stderr)
    # Start the shared embedded server once, before the children race for it.
    fleet = Fleet.connect(settings, start_embedded=True)  # the store must have its epoch
    fleet.check_eviction_policy()
    _ = fleet.sandbox  # an explicit sandbox mode that cannot work here stops the start
    measure_clock_skew(fleet)
    supervisor = _Supervisor(
        _settings_json(settings),
        concurrency=concurrency,
        burst=burst,
        policy=RestartPolicy.from_settings(settings),
        background=background,
    )
    return supervisor.run()
