"""The multi-host drill: ``ratchet drill --hosts N``.

N simulated hosts (:mod:`ratchet.chaos.drill.hostns`: a mount and UTS namespace each, its
own disk at one shared path), one fleet: one ``redis-server`` (AOF, ``appendfsync
always``) and the orders service, both outside the hosts on loopback, workers on every
host (:mod:`ratchet.chaos.drill.hostfleet`). Each run is submitted on its host (its
workspace made on that host's disk, :func:`ratchet.ops.submit` called inside the host so
the signed document names it), a few at a time. Faults: SIGKILL at the crash windows on
every host; hosts lost whole and brought back, with the operator acting meanwhile
(:mod:`ratchet.chaos.drill.hostloss`); a run in flight cancelled (then its task submitted
again); jobs put on the wrong queue. The checker is :mod:`ratchet.chaos.drill.hostchecks`.

A separate runner, not a mode of :mod:`ratchet.chaos.drill.runner`: that one's faults are
aimed at one store and one disk (rollbacks, partitions, full disks), its workers are
``multiprocessing`` children of the drill; here every process lives in a namespace and a
host's whole life is the fault. Sharing the 1,200-line loop would thread "which host" and
"is it up" through every fault there; the two share the services (the run's plan, the
orders tenants, the failpoint schedule, the classification of a run) instead.

Every wait is a poll with a deadline; every process is stopped in ``finally``.
"""

from __future__ import annotations

import os
import random
import secrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from pydantic import SecretStr
from redis.exceptions import RedisError

from ratchet.adapters.sandbox import for_own_verifiers
from ratchet.chaos.drill.cluster import choose_redis
from ratchet.chaos.drill.hostfleet import DrillHost
from ratchet.chaos.drill.hostgit import GitSchedule, GitServer, ServerKill, make_drill_remote
from ratchet.chaos.drill.hostgitloss import GitEpisode, held_by
from ratchet.chaos.drill.hostloss import REVIEWER, CancelThenSubmit, Command, Episode
from ratchet.chaos.drill.hostns import HostNamespace, namespaces_usable
from ratchet.chaos.drill.hostplan import HostDrillOptions, HostDrillRecord, RunInfo, host_name
from ratchet.chaos.drill.hostreport import check_hosts
from ratchet.chaos.drill.runner import classify_run
from ratchet.chaos.drill.schedule import Schedule
from ratchet.chaos.drill.services import TenantOrders
from ratchet.errors import ConfigurationError, RatchetError
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.leasing import RedisStore

__all__ = ["run_host_drill"]

_TICK_S = 0.05
_STRANDED = 4  # unfinished runs a loss waits for (fewer after 20 s and 40 s)
#: git-server-kill: when each kill is armed (fraction of the runs ended).
_SERVER_KILLS_AT = (0.3, 0.6)
Progress = Callable[[str, int, int], None]


class HostDrill:
    """The drill's loop (see the module docstring); also the :class:`LossContext`."""

    def __init__(
        self,
        options: HostDrillOptions,
        record: HostDrillRecord,
        fleet: Fleet,
        hosts: dict[str, DrillHost],
        orders_urls: dict[int, str],
        operator_env: dict[str, str],
        reviewer_key: Path,
        progress: Progress | None = None,
        server: GitServer | None = None,
    ) -> None:
        self.options, self.record, self.fleet, self.hosts = options, record, fleet, hosts
        self.server = server
        self.orders_urls, self.operator_env = orders_urls, operator_env
        self.reviewer_key, self.progress = reviewer_key, progress
        self.rng = random.Random(options.seed + 101)  # noqa: S311 - reproducible
        names = list(hosts)
        self.pending: dict[str, list[int]] = {h: [] for h in names}
        for index in range(options.runs):  # each run on a host of the seed's choosing
            self.pending[names[(index + options.seed) % len(names)]].append(index)
        self.again: list[str] = []  # cancelled runs whose task is submitted again
        self.tries: dict[str, int] = {}
        self.submit_after: dict[str, float] = {}  # git: a host's next submit after a failure
        kind = GitEpisode if options.git else Episode
        self.episodes = [
            kind(names[k], {"host": names[k]}, random.Random(options.seed * 31 + i))  # noqa: S311
            for i, k in enumerate(options.host_order())
        ]
        record.losses = [e.log for e in self.episodes]
        self.due_since: dict[int, float] = {}
        self.live_cancel: CancelThenSubmit | None = None
        self.misroutes_at = [0.0, 0.3] if "misroute" in options.faults else []
        self.cancel_skipped = False
        self.running: list[Command] = []
        self.injecting = True
        self.last_observe = 0.0
        self.deadline = 0.0
        self.last_progress = 0.0  # when a run was last submitted or seen ending
        self.server_kills: list[ServerKill] = []
        if "git-server-kill" in options.faults:
            if server is not None and server.daemon:
                self.server_kills = [ServerKill(at, {"at": at}) for at in _SERVER_KILLS_AT]
                record.server_kills = [k.log for k in self.server_kills]
            else:
                record.skipped["git-server-kill"] = (
                    "no git program: the remote is reached over file://, no server to kill"
                )

    # -- LossContext --------------------------------------------------------------------

    def unfinished(self, host: str) -> list[str]:
        """The host's submitted runs the drill has not seen end."""
        return [
            r
            for r, info in self.record.runs.items()
            if info.host == host and self.record.final.get(r, ("", ""))[0] != "terminal"
        ]

    def submit_again(self, run_id: str) -> None:
        self.again.append(run_id)

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        started = time.time()
        self.record.started_at = started
        while True:
            self.tick()
            now = time.time()
            if self.injecting and (self._injected_all() or now - started > self.options.duration_s):
                self.injecting = False
                self.record.injection_ended_at = now
                self.deadline = now + self.options.settle_bound_s
                for episode in self.episodes:
                    if episode.stage == "planned":
                        episode.log["skipped"] = "the drill's --duration ran out first"
                        episode.stage = "done"
                for kill in self.server_kills:
                    if kill.stage == "planned":
                        kill.log["skipped"] = "the drill's --duration ran out first"
                        kill.stage = "done"
            # Settling ends when everything ended, or when nothing moved for the settle
            # bound (a run submitted or ended is progress: the last tasks still run).
            idle_since = max(self.deadline, self.last_progress + self.options.settle_bound_s)
            if not self.injecting and (self._settled() or now > idle_since):
                return
            time.sleep(_TICK_S)

    def tick(self) -> None:
        try:
            patience = max(12.0, 12 * self.options.lease_ttl_s)
            for host in self.hosts.values():
                if host.up:
                    host.reap(injecting=self.injecting)
                    host.recycle(patience, injecting=self.injecting)
                    host.staff(self.options.workers, injecting=self.injecting)
            self._answers()
            self._submit()
            self._observe()
            self._episodes()
            self._operator()
            self._server_faults()
        except (RatchetError, RedisError, OSError) as exc:
            self.record.errors.append(f"tick: {type(exc).__name__}: {exc}"[:300])
        if self.progress is not None:
            done = sum(1 for s, _ in self.record.final.values() if s == "terminal")
            total = self.options.runs + len(self.record.cancels)
            self.progress("hosts", done, total)

    def _fraction(self) -> float:
        done = sum(1 for s, _ in self.record.final.values() if s in ("terminal", "frozen"))
        return done / self.options.runs

    def _injected_all(self) -> bool:
        """Every fault injected and every run submitted."""
        return (
            all(e.stage == "done" for e in self.episodes)
            and not any(self.pending.values())
            and not self.again
            and not self.misroutes_at
            and all(k.stage == "done" for k in self.server_kills)
            and (
                self.live_cancel is not None
                or self.cancel_skipped
                or "cancel" not in self.options.faults
            )
        )

    def _settled(self) -> bool:
        busy = any(e.stage not in ("done", "planned") for e in self.episodes)
        cancels = self.live_cancel is not None and not self.live_cancel.done
        if busy or cancels or self.again or any(self.pending.values()):
            return False
        if any(h.outstanding is not None for h in self.hosts.values()):
            return False
        if any(k.stage in ("watching", "down") for k in self.server_kills):
            return False
        # Every run the drill submitted, also one whose answer came after the last look.
        ended = ("terminal", "frozen")
        return all(self.record.final.get(r, ("", ""))[0] in ended for r in self.record.runs)

    # -- submitting ---------------------------------------------------------------------

    def _cap(self, host: str) -> int:
        """Runs of ``host`` in flight at most: workers + 1; while its loss is due, one more
        than the loss waits for, so it finds several runs to strand. Each loss of the host
        still to come and not due holds back six of its tasks (more than it strands: some
        end while the others are submitted)."""
        planned = [
            i for i, e in enumerate(self.episodes) if e.host == host and e.stage == "planned"
        ]
        if not self.injecting or not planned:
            return self.options.workers + 1
        due = planned[0] in self.due_since
        if len(self.pending[host]) <= (_STRANDED + 2) * (len(planned) - due):
            return 0
        return max(self.options.workers + 1, _STRANDED + 1) if due else self.options.workers + 1

    def _submit(self) -> None:
        if any(k.stage == "down" for k in self.server_kills):
            return  # no branch can be made while the git server is down: the operator waits
        for name, host in self.hosts.items():
            if not host.up or host.outstanding is not None:
                continue
            if time.time() < self.submit_after.get(name, 0.0):
                continue
            # A git run's task may be submitted again on any host; a folder's on its own.
            mine = (r for r in self.again if self.options.git or self.record.runs[r].host == name)
            again = next(mine, None)
            request: dict[str, Any]
            if again is not None:
                index = self.record.runs[again].index
                request = {"index": index, "run_id": f"{again}-again", "again_of": again}
            elif self.pending[name] and len(self.unfinished(name)) < self._cap(name):
                index = self.pending[name][0]
                request = {"index": index, "run_id": f"hosts-{self.options.seed}-{index}"}
            else:
                continue
            request.update(orders_url=self.orders_urls[index], think_ms=self.options.think_ms)
            if self.options.git:
                request["remote"] = self.record.remote_url
            if host.ask(request):
                if again is not None:
                    self.again.remove(again)
                else:
                    self.pending[name].pop(0)

    def _answers(self) -> None:
        for name, host in self.hosts.items():
            reply = host.answer()
            if reply is None and host.outstanding is not None:
                if time.time() - float(host.outstanding["asked_at"]) < 60:
                    continue
                reply = {"ok": False, "error": "no answer in 60 s", "request": host.outstanding}
                host.outstanding = None
            if reply is None:
                continue
            request = reply["request"] or {}
            run_id = str(request.get("run_id"))
            if not reply.get("ok"):
                self.record.errors.append(f"submit {run_id} on {name}: {reply.get('error')}")
                if self.options.git:  # the git server may be down (a kill): a while later
                    self.submit_after[name] = time.time() + 1.0
                if not self._exists(run_id):
                    self.tries[run_id] = self.tries.get(run_id, 0) + 1
                    if self.tries[run_id] < 3:  # asked again later
                        if request.get("again_of"):
                            self.again.append(str(request["again_of"]))
                        else:
                            self.pending[name].insert(0, int(request["index"]))
                    continue
                self.fleet.enqueue(run_id)  # created, its enqueue lost: hand it out
            self.last_progress = time.time()
            self.record.runs[run_id] = RunInfo(
                run_id,
                int(request["index"]),
                name,
                again_of=request.get("again_of"),
                submitted_at=time.time(),
                submitted_host=reply.get("host"),
            )

    def _exists(self, run_id: str) -> bool:
        try:
            self.fleet.store.read_run(run_id)
        except RatchetError:
            return False
        return True

    def _observe(self) -> None:
        now = time.time()
        if now - self.last_observe < 0.2:
            return
        self.last_observe = now
        for run_id in self.record.runs:
            if self.record.final.get(run_id, ("", ""))[0] == "terminal":
                continue
            try:
                self.record.final[run_id] = classify_run(self.fleet, run_id)
            except RatchetError as exc:
                self.record.final[run_id] = ("unreadable", type(exc).__name__)
            if self.record.final[run_id][0] == "terminal":
                self.record.terminal_at.setdefault(run_id, now)
                self.last_progress = now

    # -- faults -------------------------------------------------------------------------

    def _episodes(self) -> None:
        for number, episode in enumerate(self.episodes):
            if episode.stage in ("gone", "returned"):
                if not self.injecting and episode.stage == "gone":
                    episode.log.setdefault("errors", []).append("brought back: drill ending")
                    episode.bring_back(self)
                episode.step(self)
                continue
            if episode.stage != "planned" or not self.injecting:
                continue
            earlier = self.episodes[:number]
            if any(e.stage in ("planned", "gone") for e in earlier):
                return
            at = 0.15 + 0.55 * number / max(1, len(self.episodes))
            # Nothing in flight anywhere (every other run held back): due now.
            idle = bool(self.record.runs) and not any(self.unfinished(h) for h in self.hosts)
            if self._fraction() < at and not idle and number not in self.due_since:
                return
            since = self.due_since.setdefault(number, time.time())
            if self.options.git:
                self._arm_git(episode, time.time() - since)
            else:
                self._arm(episode, time.time() - since)
            return

    def _arm(self, episode: Episode, waited: float) -> None:
        """Lose the host once enough of its runs are unfinished and one is mid-run (less
        and less demanding the longer it waited), with no submit of it in flight."""
        host = self.hosts[episode.host]
        if not host.up or host.outstanding is not None:
            return
        self.running = [c for c in self.running if c.proc.poll() is None]
        if any(c.host == episode.host for c in self.running):
            return  # an operator's command runs on this host: it is not lost under it
        mine = self.unfinished(episode.host)
        live = [r for r in mine if self._live(r)]
        want, need_live = (
            (_STRANDED, True) if waited < 20 else (3, True) if waited < 40 else (1, False)
        )
        if not mine and not self.pending[episode.host]:
            episode.log["skipped"] = "no run left on the host"
            episode.stage = "done"
            return
        if len(mine) >= want and (live or not need_live):
            episode.log["waited_s"] = round(waited, 2)
            episode.lose(self)

    def _arm_git(self, episode: Episode, waited: float) -> None:
        """Lose the host once its workers hold live leases of runs (both of them, one
        after 20 s), so the loss strands runs mid-flight; after 60 s whatever they hold."""
        host = self.hosts[episode.host]
        if not host.up or host.outstanding is not None:
            return
        self.running = [c for c in self.running if c.proc.poll() is None]
        if any(c.host == episode.host for c in self.running):
            return
        if not any(self.pending.values()) and not any(self.unfinished(h) for h in self.hosts):
            episode.log["skipped"] = "no run left to strand"
            episode.stage = "done"
            return
        held = held_by(self, episode.host)
        want = min(2, self.options.workers) if waited < 20 else 1
        if len(held) >= want or waited > 60:
            episode.log["waited_s"] = round(waited, 2)
            episode.lose(self)

    def _server_faults(self) -> None:
        """git-server-kill: arm the next kill once its fraction of the runs ended and a
        lease is live (pushes come from runs in flight), then step it to its restart."""
        server = self.server
        current = next((k for k in self.server_kills if k.stage != "done"), None)
        if server is None or current is None:
            return
        if current.stage == "planned":
            if not self.injecting or self._fraction() < current.at:
                return
            if any(self._live(r) for h in self.hosts for r in self.unfinished(h)):
                current.arm(server)
            return
        current.step(server)

    def _live(self, run_id: str) -> bool:
        try:
            return bool(self.fleet.store.read_run(run_id).lease_live)
        except RatchetError:
            return False

    def _operator(self) -> None:
        """The in-flight cancel (then the task submitted again) and the misroutes of runs
        of live hosts, each once some run ended and a run to act on is in flight; given up
        (and said so) when no run is left to act on."""
        up = [h for h, d in self.hosts.items() if d.up]
        targets = [r for h in up for r in self.unfinished(h) if self._free(r)]
        started = self._fraction() > 0 and len(up) >= 2 and self.injecting
        if self.live_cancel is not None:
            self.live_cancel.step(self)
        elif "cancel" in self.options.faults and started and not self.cancel_skipped:
            live = [r for r in targets if self._live(r)]
            if live:
                run = self.record.runs[self.rng.choice(live)]
                on_host = self.rng.choice([h for h in up if h != run.host])
                log: dict[str, Any] = {"run_id": run.run_id, "on_host": on_host, "in_flight": True}
                self.record.cancels.append(log)
                self.live_cancel = CancelThenSubmit(run, on_host, log)
            elif self._nothing_left(targets):
                self.cancel_skipped = True
                self.record.skipped["cancel (in flight)"] = "no run in flight to cancel"
        if self.misroutes_at and started and self._fraction() >= self.misroutes_at[0]:
            if targets:
                self.misroutes_at.pop(0)
                run = self.record.runs[self.rng.choice(targets)]
                to = self.rng.choice([h for h in up if h != run.host])
                for queue_host in (to, None):
                    self.fleet.enqueue(run.run_id, host=queue_host)
                    self.record.misroutes.append(
                        {"run_id": run.run_id, "queue_host": queue_host, "at": time.time()}
                    )
            elif self._nothing_left(targets):
                self.record.skipped[f"misroute at {self.misroutes_at.pop(0)}"] = "no run left"

    def _nothing_left(self, targets: list[str]) -> bool:
        """No run to act on now, and none still to submit."""
        return not targets and not any(self.pending.values())

    def _free(self, run_id: str) -> bool:
        """Not a run some other fault already acts on."""
        busy = {c["run_id"] for c in self.record.cancels}
        for loss in self.record.losses:
            busy |= set(loss.get("runs", {}))
        return run_id not in busy and self.record.runs[run_id].again_of is None

    def stop(self) -> None:
        """Kill the operator commands still running (the drill is ending); the git server
        up again if a kill left it down."""
        if self.server is not None:
            for kill in self.server_kills:
                if kill.stage != "done":
                    kill.abandon(self.server)
        for command in self.running:
            if command.proc.poll() is None:
                command.proc.kill()
                command.proc.wait(timeout=10)


def _host_env(
    options: HostDrillOptions, url: str, key_hex: str, folder: Path, mountpoint: Path
) -> dict[str, str]:
    """Every host process's environment: the fleet's settings (no RATCHET_HOST: the host
    name is the namespace's). With git runs each host keeps its state (the git object
    cache and checkouts) on its own disk."""
    ttl = options.ttl_ms
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_REDIS_URL=url,
        RATCHET_CHECKPOINT_KEY=key_hex,
        RATCHET_QUEUE=f"drill-hosts-{options.seed}",
        RATCHET_LEASE_TTL_MS=str(ttl),
        RATCHET_RENEW_INTERVAL_MS=str(max(ttl // 3, 50)),
        RATCHET_STALL_TIMEOUT_MS=str(max(20 * ttl, 20_000)),
        RATCHET_REAPER_INTERVAL_MS=str(max(ttl // 5, 50)),
        RATCHET_JOB_TIMEOUT_S=str(max(600, ttl // 100)),
        RATCHET_PICKUP_TIMEOUT_MS=str(max(3 * ttl, 1000)),
        RATCHET_HOST_TIMEOUT_MS=str(options.host_timeout_ms),
        RATCHET_VERIFIER_SANDBOX=for_own_verifiers().value,
        RATCHET_REVIEWERS_FILE=os.fspath(folder / "trust" / "reviewers.json"),
        RATCHET_STATE_DIR=os.fspath(mountpoint / "state" if options.git else folder / "state"),
        RATCHET_LOG_LEVEL="WARNING",
        USER="drill-operator",
    )
    return env


def _reviewer(folder: Path) -> Path:
    """The drill's reviewer key (PEM, for ``ratchet review --key``) and the workers' trust
    file of its public half. Returns the key's path."""
    trust = folder / "trust"
    trust.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    (trust / "reviewers.json").write_text(f'{{"{REVIEWER}": "{public}"}}')
    path = trust / "reviewer.pem"
    path.write_bytes(key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    path.chmod(0o600)
    return path


def run_host_drill(
    options: HostDrillOptions, *, progress: Progress | None = None
) -> dict[str, Any]:
    """Run a multi-host drill and return its report (also written to ``report.json`` in
    the drill folder). Every process it started is stopped before it returns, also on
    errors. Raises ConfigurationError (not root, util-linux missing, bad options)."""
    options.check()
    reason = namespaces_usable()
    if reason is not None:
        raise ConfigurationError(f"the multi-host drill cannot run here: {reason}")
    folder = Path(options.folder or tempfile.mkdtemp(prefix="ratchet-drill-hosts-"))
    folder.mkdir(parents=True, exist_ok=True)
    record = HostDrillRecord(folder=folder, options=options)
    server = choose_redis(options.redis_server, want_rollback=False).server(folder / "redis")
    hosts: dict[str, DrillHost] = {}
    orders: TenantOrders | None = None
    drill: HostDrill | None = None
    remote: GitServer | None = None
    server.start()
    try:
        if options.git:
            make_drill_remote(record.remote_path)
            remote = GitServer(record.remote_path)
            remote.start()
            record.remote_url = remote.url
            record.remote_served = "git daemon" if remote.daemon else "file://"
        RedisStore(server.client()).identity.init_epoch()
        orders = TenantOrders(folder / "orders")
        urls = {i: orders.add(f"t{i}") for i in range(options.runs)}
        key_hex = secrets.token_hex(32)
        reviewer_key = _reviewer(folder)
        env = _host_env(options, server.url, key_hex, folder, record.mountpoint)
        record.sandbox = env["RATCHET_VERIFIER_SANDBOX"]
        fleet = Fleet.connect(
            Settings(
                redis_url=SecretStr(server.url),
                checkpoint_key=SecretStr(key_hex),
                queue=env["RATCHET_QUEUE"],
                lease_ttl_ms=options.ttl_ms,
                pickup_timeout_ms=max(3 * options.ttl_ms, 1000),
                host_timeout_ms=options.host_timeout_ms,
                state_dir=folder / "state",
                reviewers_file=folder / "trust" / "reviewers.json",
            )
        )
        for number in range(options.hosts):
            name = host_name(number)
            record.hosts.append(name)
            kills = options.faults & {"kill"}
            per_host = options.runs // options.hosts
            kind = GitSchedule if options.git else Schedule
            schedule = kind(options.seed * 1009 + number, kills, per_host, repeats=1)
            ns = HostNamespace(name, record.host_backing(name), record.mountpoint)
            hosts[name] = DrillHost(name, ns, env, folder, schedule)
            hosts[name].start()
        operator_env = {**env, "RATCHET_LOG_LEVEL": "ERROR"}
        drill = HostDrill(
            options, record, fleet, hosts, urls, operator_env, reviewer_key, progress, remote
        )
        drill.run()
        drill.stop()
        for host in hosts.values():
            host.stop()
        for run_id in record.runs:  # the last word on every run, every worker stopped
            try:
                record.final[run_id] = classify_run(fleet, run_id)
            except RatchetError as exc:
                record.final[run_id] = ("unreadable", type(exc).__name__)
        record.finished_at = time.time()
        for name, host in hosts.items():
            record.deaths[name], record.fired[name] = host.deaths, host.fired
            record.workers_started[name] = host.started
        report = check_hosts(record, fleet)
    finally:
        left: list[ConfigurationError] = []  # processes that outlived SIGKILL: said below
        try:
            if drill is not None:
                drill.stop()
            for host in hosts.values():
                try:
                    host.ns.lose()
                except ConfigurationError as exc:
                    left.append(exc)
        finally:
            if orders is not None:
                orders.stop()
            if remote is not None:
                remote.kill()
            server.stop()
        if left:
            raise left[0]
    return report
