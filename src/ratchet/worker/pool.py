"""Worker processes: an RQ ``SimpleWorker`` per process, plus a reaper thread.

``SimpleWorker`` runs each job in the worker process itself (no fork per job: RQ's forking
worker costs about 10 ms per job), so a SIGKILL of the worker is a SIGKILL of the job, and
ratchet's lease expiry plus the reaper recover the run.

Signals: the first SIGTERM (or SIGINT) sets :data:`ratchet.worker.job.STOP`; the running
job finishes its current step, which is committed, releases the lease for reaping and
returns; RQ then stops the worker (warm shutdown). A second SIGTERM is RQ's cold shutdown;
the lease then expires and another worker's reaper hands the run on.

:func:`run_pool` starts N such processes and forwards SIGTERM/SIGINT to them.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

from rq import SimpleWorker
from rq.serializers import JSONSerializer

from ratchet.errors import ConfigurationError
from ratchet.worker import job, logs, metrics
from ratchet.worker.clock import check_clock_skew
from ratchet.worker.context import Fleet, ensure_embedded_redis
from ratchet.worker.failpoints import events_from_env, probe_from_env
from ratchet.worker.identity import owner_id
from ratchet.worker.reaper import Reaper
from ratchet.worker.settings import Settings

__all__ = ["RatchetWorker", "run_pool", "worker_main"]

log = logging.getLogger("ratchet.worker.pool")


class RatchetWorker(SimpleWorker):
    """RQ's in-process worker, with JSON jobs and a graceful stop between steps."""

    def handle_warm_shutdown_request(self) -> None:
        job.STOP.set()
        super().handle_warm_shutdown_request()  # type: ignore[no-untyped-call]


def worker_main(settings_json: str, index: int, burst: bool = False) -> None:
    """Entry point of one worker process."""
    # Text by default, JSON lines with RATCHET_LOG_FORMAT=json; level RATCHET_LOG_LEVEL.
    logs.configure_logging(stream=sys.stderr)
    settings = Settings.model_validate_json(settings_json)
    fleet = Fleet.connect(settings)
    points = probe_from_env()
    if points is not None:
        # Drills: the store lets the failpoints drop or kill at a commit's reply.
        fleet.store.reply_hook = points.commit_reply
    job.configure(fleet, points, events_from_env())
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
    reaper = Reaper(fleet.store, fleet.enqueue, interval_ms=settings.reaper_interval_ms,
                    reclaim_after_ms=settings.pickup_timeout_ms).start()
    worker = RatchetWorker([fleet.queue], connection=fleet.rq_connection,
                           serializer=JSONSerializer, name=f"{owner}-{index}")
    try:
        worker.work(burst=burst, with_scheduler=False, logging_level="WARNING")
    finally:
        reaper.stop()


def _settings_json(settings: Settings) -> str:
    # Secrets travel to the child processes through this JSON (never through argv or logs).
    data: dict[str, Any] = settings.model_dump(mode="json")
    for name in ("redis_url", "checkpoint_key"):
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
        skew = check_clock_skew(store_ms, sent_at_wall=sent, received_at_wall=received,
                                max_skew_ms=fleet.settings.max_clock_skew_ms)
    except ConfigurationError:
        metrics.CLOCK_SKEW.set(((sent + received) / 2 * 1000 - store_ms) / 1000)
        raise
    metrics.CLOCK_SKEW.set(skew)
    return skew


def run_pool(settings: Settings, *, concurrency: int, burst: bool = False) -> int:
    """Start ``concurrency`` worker processes and wait for them. Returns an exit code.

    Raises ConfigurationError before anything starts when this host's clock is too far
    from Redis' (see :mod:`ratchet.worker.clock`) or the verifier sandbox asked for
    cannot work here.
    """
    if settings.embedded:
        # Start the shared embedded server once, before the children race for it.
        ensure_embedded_redis(settings.state_dir)
    fleet = Fleet.connect(settings)  # the store must have its epoch
    fleet.check_eviction_policy()
    _ = fleet.sandbox  # an explicit sandbox mode that cannot work here stops the start
    measure_clock_skew(fleet)
    ctx = mp.get_context("spawn")
    payload = _settings_json(settings)
    procs = [ctx.Process(target=worker_main, args=(payload, i, burst), daemon=False)
             for i in range(concurrency)]
    for proc in procs:
        proc.start()

    def forward(signum: int, _frame: FrameType | None) -> None:
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for proc in procs:
            proc.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return max((proc.exitcode or 0) for proc in procs)
