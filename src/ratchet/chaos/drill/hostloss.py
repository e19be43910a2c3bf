"""A host lost whole, its runs waiting, the operator acting, and the host coming back.

One :class:`Episode` per host loss, stepped by the drill's loop (every wait a poll with a
deadline). In order:

1. **lost**: every process of the host SIGKILLed, its namespace and disk gone;
2. **gone**: wait until the fleet sees the host gone (no worker reported in for the host
   timeout) and every lease of its runs expired; snapshot its unfinished runs (generation,
   phase, checkpoint); then, as an operator on a surviving host:

   * ``misroute``: one waiting run put on a surviving host's queue and on the shared one
     (a stale hint): the workers that take it must hand it on, not open it;
   * ``retry``: ``ratchet retry`` of a waiting run;
   * ``cancel``: ``ratchet cancel`` of another (carried out only by its host's worker,
     once back; then the same task is submitted again there);
   * ``rebaseline``: the note of a third run (no write pending, its last write to come)
     changed on the lost host's disk by hand, as a person fixing a disk while its machine
     is down would;

   and watch every unfinished run of the host show as waiting for it
   (``ratchet show``'s ``status.waiting_for_host``), until the commands ended and the
   misrouted jobs were handed on;
3. **returned**: the host started again on the same disk (its workers by the drill's
   loop). The changed run must freeze (its environment is not the checkpoint's); the
   operator then tries ``ratchet review --decision rebaseline`` from another host
   (refused: the workspace is not there) and from the run's own host (signed and
   applied). The cancelled run ends cancelled and its task is submitted again.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from redis.exceptions import RedisError

from ratchet.chaos.drill.hostfleet import DrillHost, operator_argv
from ratchet.chaos.drill.hostplan import HostDrillOptions, HostDrillRecord, RunInfo
from ratchet.chaos.drill.hostproc import workspace_name
from ratchet.chaos.drill.services import NOTE
from ratchet.errors import RatchetError
from ratchet.fleet.context import Fleet
from ratchet.ops import inspect_run
from ratchet.ops.diagnosis import diagnose
from ratchet.runtime.state import TERMINAL_PHASES

__all__ = [
    "REVIEWER",
    "CancelThenSubmit",
    "Command",
    "Episode",
    "LossContext",
    "lease_live",
    "snapshot",
]

#: The drill's reviewer id (its key signs the rebaselines).
REVIEWER = "drill-hosts-reviewer"
_TAMPERED = "changed by hand while the host was down\n"


class LossContext(Protocol):
    """What an episode needs of the drill."""

    fleet: Fleet
    hosts: dict[str, DrillHost]
    options: HostDrillOptions
    record: HostDrillRecord
    operator_env: dict[str, str]
    reviewer_key: Path
    running: list[Command]  # every operator command started (a host is not lost under one)

    def unfinished(self, host: str) -> list[str]: ...

    def submit_again(self, run_id: str) -> None: ...


@dataclass
class Command:
    """An operator's ``ratchet`` command running on a host, polled to its end."""

    what: str
    host: str
    proc: subprocess.Popen[bytes]
    out: Path
    started: float
    deadline_s: float = 90.0

    @classmethod
    def start(cls, ctx: LossContext, host: str, what: str, *args: str) -> Command:
        out = ctx.record.folder / "operator" / f"{what}-{time.time_ns()}.out"
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("wb") as stdout:
            proc = ctx.hosts[host].ns.popen(
                operator_argv(*args),
                env=ctx.operator_env,
                log=out.with_suffix(".err"),
                stdout=stdout,
            )
        command = cls(what, host, proc, out, time.time())
        ctx.running.append(command)
        return command

    def result(self) -> dict[str, Any] | None:
        """None while it runs; then its exit code, JSON answer and the tail of its stderr
        (a command past its deadline is killed: ``exit`` None)."""
        code = self.proc.poll()
        if code is None:
            if time.time() - self.started < self.deadline_s:
                return None
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(timeout=10)
        text = self.out.read_text(errors="replace")
        answer: Any = None
        with contextlib.suppress(ValueError):
            answer = json.loads(text) if text.strip() else None
        err = self.out.with_suffix(".err")
        tail = err.read_text(errors="replace")[-600:] if err.exists() else ""
        return {
            "what": self.what,
            "on_host": self.host,
            "exit": code,
            "answer": answer,
            "stderr": tail,
            "seconds": round(time.time() - self.started, 2),
        }


@dataclass
class CancelThenSubmit:
    """``ratchet cancel`` of a run from ``on_host``, then, once the run ended cancelled,
    the same task submitted again on its host."""

    run: RunInfo
    on_host: str
    log: dict[str, Any]
    command: Command | None = None
    done: bool = False
    retargets: int = 0

    def step(self, ctx: LossContext) -> None:
        if self.done:
            return
        if self.command is None:
            if not ctx.hosts[self.on_host].up:
                return
            why = ("--reason", "drill: the operator ends the run", "--json")
            self.command = Command.start(
                ctx, self.on_host, "cancel", "cancel", self.run.run_id, *why
            )
            self.log["asked_at"] = time.time()
            return
        if "command" not in self.log:
            result = self.command.result()
            if result is None:
                return
            self.log["command"] = result
            if result["exit"] != 0:
                if self._retarget(ctx, result):
                    return
                self.done = True
                return
        phase = ctx.record.final.get(self.run.run_id, ("", ""))[1]
        if phase not in {p.value for p in TERMINAL_PHASES}:
            return
        self.log["ended"], self.log["ended_at"] = phase, time.time()
        if phase == "cancelled":
            ctx.submit_again(self.run.run_id)
        self.done = True

    def _retarget(self, ctx: LossContext, result: dict[str, Any]) -> bool:
        """A run that ended before the command reached it ("nothing to cancel": on a
        loaded machine a run another host took over can finish first) leaves the fault
        unexercised: the next run still going is cancelled instead, up to three times.
        Returns whether a new target was taken."""
        if "nothing to cancel" not in str(result.get("stderr", "")) or self.retargets >= 3:
            return False
        taken = {str(c.get("run_id")) for c in ctx.record.cancels}
        for run_id, info in sorted(ctx.record.runs.items(), key=lambda kv: kv[1].index):
            going = ctx.record.final.get(run_id, ("", ""))[0] != "terminal"
            if going and run_id not in taken and not run_id.endswith("-again"):
                self.log.setdefault("ended_first", []).append(
                    {"run_id": self.run.run_id, "command": self.log.pop("command")}
                )
                self.run, self.command, self.retargets = info, None, self.retargets + 1
                self.log["run_id"] = run_id
                return True
        return False


@dataclass
class Episode:
    """One host loss (see the module docstring)."""

    host: str
    log: dict[str, Any]
    rng: random.Random
    stage: str = "planned"  # planned | gone | returned | done
    deadline: float = 0.0
    commands: list[Command] = field(default_factory=list)
    cancel: CancelThenSubmit | None = None
    tampered: str | None = None
    rebaseline_cmds: list[Command] = field(default_factory=list)

    # -- lost ---------------------------------------------------------------------------

    def lose(self, ctx: LossContext) -> None:
        host = ctx.hosts[self.host]
        self.log["live_leases_at_loss"] = [
            r for r in ctx.unfinished(self.host) if lease_live(ctx.fleet, r)
        ]
        # Stamped once every process of the host is dead: an event one of them wrote just
        # before its SIGKILL is the host's own, not a run opened while it was gone.
        self.log["killed"] = len(host.lose())
        self.log["lost_at"] = time.time()
        self.log["lost_at_ms"] = ctx.fleet.store.server_time_ms()
        self.stage, self.deadline = "gone", time.time() + ctx.options.host_timeout_ms / 1000 + 30

    # -- gone ---------------------------------------------------------------------------

    def _gone(self, ctx: LossContext) -> None:
        if "gone_seen_at" not in self.log:
            expired = not any(lease_live(ctx.fleet, r) for r in ctx.unfinished(self.host))
            if ctx.fleet.host_seen(self.host).alive or not expired:
                if time.time() > self.deadline:
                    self.log.setdefault("errors", []).append("never seen gone")
                    self.bring_back(ctx)
                return
            self.log["gone_seen_at"] = time.time()
            # Its runs that had not ended (one may have ended just before the loss, before
            # the drill looked): each must wait now, and end only once the host is back.
            snaps = {r: snapshot(ctx.fleet, r) for r in ctx.unfinished(self.host)}
            ended = {p.value for p in TERMINAL_PHASES}
            self.log["runs"] = {r: s for r, s in snaps.items() if s.get("phase") not in ended}
            self._act(ctx)
            self.deadline = time.time() + 120
        self._watch_waiting(ctx)
        for command in list(self.commands):
            result = command.result()
            if result is not None:
                self.log.setdefault("commands", []).append(result)
                self.commands.remove(command)
        if self.cancel is not None and "command" not in self.cancel.log:
            self.cancel.step(ctx)
        waiting = self.log.setdefault("waiting_seen", {})
        misroutes = self.log.get("misroutes", [])
        routed = not misroutes or _jobs_ended(ctx.record, misroutes) >= len(misroutes)
        settled = (
            not self.commands
            and (self.cancel is None or "command" in self.cancel.log)
            and all(r in waiting for r in self.log["runs"])
            and routed
            and time.time() - self.log["gone_seen_at"] > 2.0
        )
        if settled or time.time() > self.deadline:
            if not settled:
                self.log.setdefault("errors", []).append("gone-stage deadline passed")
            self.bring_back(ctx)

    def _act(self, ctx: LossContext) -> None:
        """The operator's moves while the host is gone (see the module docstring)."""
        faults = ctx.options.faults
        cancelled = {c["run_id"] for c in ctx.record.cancels}
        runs = sorted(
            (r for r in self.log["runs"] if r not in cancelled),
            key=lambda r: ctx.record.runs[r].index,
        )
        others = [h for h, d in ctx.hosts.items() if h != self.host and d.up]
        if not runs or not others:
            self.log.setdefault("errors", []).append("no run waiting or no surviving host")
            return
        on_host = self.rng.choice(others)
        self.log["operator_host"] = on_host
        free = list(runs)
        # The misrouted run: preferably the one whose worker died with the host (its
        # expired lease is taken over by whichever worker takes the misrouted job). Never
        # the retried run: a retry is refused while a worker (the one handing the job on)
        # holds the lease.
        live = [r for r in runs if r in self.log["live_leases_at_loss"]]
        misrouted = (live or runs)[0] if "misroute" in faults else None
        if misrouted is not None:
            target = misrouted
            for queue_host in (on_host, None):
                ctx.fleet.enqueue(target, host=queue_host)
                self.log.setdefault("misroutes", []).append(
                    {"run_id": target, "queue_host": queue_host, "at": time.time()}
                )
        if "rebaseline" in faults:
            tamper = next((r for r in reversed(free) if self._tamperable(r)), None)
            if tamper is not None:
                free.remove(tamper)
                path = ctx.record.host_backing(self.host) / workspace_name(
                    ctx.record.runs[tamper].index
                )
                (path / NOTE).write_text(_TAMPERED)
                self.tampered = tamper
                self.log["rebaseline"] = {"run_id": tamper, "tampered_at": time.time()}
            else:
                self.log["rebaseline_skipped"] = "no waiting run without a pending write"
        retry = next((r for r in free if r != misrouted), None)
        cancel = next((r for r in reversed(free) if r != retry), None)
        if "cancel" in faults and cancel is not None:
            self.log["cancel"] = {"run_id": cancel, "on_host": on_host}
            self.cancel = CancelThenSubmit(ctx.record.runs[cancel], on_host, self.log["cancel"])
            ctx.record.cancels.append(self.log["cancel"])
        if "retry" in faults and retry is None:
            self.log["retry_skipped"] = "no waiting run left to retry"
        elif "retry" in faults and retry is not None:
            self.log["retry"] = {"run_id": retry}
            why = ("--reason", "drill: its host is gone")
            self.commands.append(Command.start(ctx, on_host, "retry", "retry", retry, *why))

    def _tamperable(self, run_id: str) -> bool:
        """No write pending and its last write still to come (the note it writes last is
        what the verifier reads)."""
        state = self.log["runs"][run_id]
        return bool(state.get("pending") is None and state.get("executed", 9) <= 1)

    def _watch_waiting(self, ctx: LossContext) -> None:
        """Record when each unfinished run of the host was first shown waiting for it, and
        any moment one was shown otherwise once its lease expired."""
        waiting = self.log.setdefault("waiting_seen", {})
        for run_id in self.log["runs"]:
            try:
                status = diagnose(ctx.fleet, inspect_run(ctx.fleet, run_id))["status"]
            except (RatchetError, RedisError) as exc:
                self.log.setdefault("errors", []).append(f"show {run_id}: {exc}"[:200])
                continue
            if status.get("waiting_for_host"):
                waiting.setdefault(run_id, time.time())
            elif status.get("state") not in ("running", "leased"):
                self.log.setdefault("not_waiting", []).append(
                    {"run_id": run_id, "at": time.time(), "state": status.get("state")}
                )

    def bring_back(self, ctx: LossContext) -> None:
        """The host comes back: a new namespace on its disk, under its name."""
        self.log["generations_before_return"] = {
            r: snapshot(ctx.fleet, r).get("generation") for r in self.log.get("runs", {})
        }
        ctx.hosts[self.host].start()
        self.log["returned_at"] = time.time()
        self.log["returned_at_ms"] = ctx.fleet.store.server_time_ms()
        self.stage, self.deadline = "returned", time.time() + 150

    # -- returned -----------------------------------------------------------------------

    def _returned(self, ctx: LossContext) -> None:
        for command in list(self.commands):  # a command that outlived the gone stage
            result = command.result()
            if result is not None:
                self.log.setdefault("commands", []).append(result)
                self.commands.remove(command)
        if self.cancel is not None:
            self.cancel.step(ctx)
        rebased = self.tampered is None or self._rebaseline(ctx)
        if (rebased and (self.cancel is None or self.cancel.done) and not self.commands) or (
            time.time() > self.deadline
        ):
            if time.time() > self.deadline:
                self.log.setdefault("errors", []).append("returned-stage deadline passed")
            self.stage = "done"

    def _rebaseline(self, ctx: LossContext) -> bool:
        """Wait for the changed run to freeze, then the wrong host's attempt, then the
        right host's. True once done (or given up)."""
        log = self.log["rebaseline"]
        run_id = str(log["run_id"])
        status, phase = ctx.record.final.get(run_id, ("", ""))
        if "froze_at" not in log:
            if status == "frozen":
                log["froze_at"] = time.time()
            elif status == "terminal":
                log["ended_without_freezing"] = phase
                return True
            return False
        others = [h for h, d in ctx.hosts.items() if h != self.host and d.up]
        args = ("review", run_id, "--decision", "rebaseline", "--key", str(ctx.reviewer_key))
        if not self.rebaseline_cmds:
            if not others:
                return False
            wrong = self.rng.choice(others)
            self.rebaseline_cmds.append(
                Command.start(ctx, wrong, "rebaseline-wrong-host", *args, "--id", REVIEWER)
            )
            return False
        result = self.rebaseline_cmds[-1].result()
        if result is None:
            return False
        key = "wrong_host" if len(self.rebaseline_cmds) == 1 else "own_host"
        if key not in log:
            log[key] = result
        if key == "wrong_host":
            self.rebaseline_cmds.append(
                Command.start(ctx, self.host, "rebaseline", *args, "--id", REVIEWER, "--json")
            )
            return False
        return True

    def step(self, ctx: LossContext) -> None:
        try:
            if self.stage == "gone":
                self._gone(ctx)
            elif self.stage == "returned":
                self._returned(ctx)
        except (RatchetError, RedisError, OSError) as exc:
            self.log.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}"[:300])


def lease_live(fleet: Fleet, run_id: str) -> bool:
    try:
        return bool(fleet.store.read_run(run_id).lease_live)
    except RatchetError:
        return False


def snapshot(fleet: Fleet, run_id: str) -> dict[str, Any]:
    """A run's verified state as it is now: generation, phase, the lease, its writes."""
    try:
        view = inspect_run(fleet, run_id)
    except RatchetError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    state = view.state
    return {
        "generation": view.generation,
        "phase": state.phase.value,
        "lease_version": view.snapshot.lease_version,
        "lease_live": view.snapshot.lease_live,
        "pending": state.pending.action.idempotency_key if state.pending is not None else None,
        "executed": state.executed_base + len(state.executed),
    }


def _jobs_ended(record: HostDrillRecord, misroutes: list[dict[str, Any]]) -> int:
    """How many jobs of the misrouted run ended (handed on, or its lease held elsewhere)
    after it was misrouted, by the hosts' event logs."""
    run_id, at = misroutes[0]["run_id"], min(float(m["at"]) for m in misroutes)
    count = 0
    for host in record.hosts:
        for path in (record.folder / "events" / host).glob("events-*.jsonl"):
            with contextlib.suppress(OSError):
                for line in path.read_text(errors="replace").splitlines():
                    if run_id not in line or '"job_end"' not in line:
                        continue
                    with contextlib.suppress(ValueError):
                        event = json.loads(line)
                        if event.get("run_id") == run_id and float(event.get("at", 0)) >= at:
                            count += 1
    return count
