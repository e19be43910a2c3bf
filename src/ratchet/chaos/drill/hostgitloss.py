"""A host lost whole while it runs git-workspace runs, which continue elsewhere at once.

A git run lives on a branch of the remote, not on its host's disk, and is bound to no
host: a worker of any host continues it once its lease expired. One :class:`GitEpisode`
per host loss, stepped by the drill's loop (every wait a poll with a deadline):

1. **lost**: the runs whose live lease a worker of the host holds are noted (read again
   once every process of the host is dead), then the host is lost whole; those of them
   that had not ended are the runs the loss strands;
2. **gone**: right after the loss, as an operator on a surviving host:

   * ``cancel``: ``ratchet cancel`` of one stranded run (carried out by whichever worker
     takes it; then the task is submitted again, on any host that is up);
   * ``retry``: ``ratchet retry`` of another, sent the moment its lease expired (it races
     the takeover: accepted, the run is enqueued once more; refused, a worker of another
     host holds it already);

   and watch each stranded run be taken by a worker of another host and end, the lost
   host still gone. Once each ended (or a deadline passed) and the commands ended:
3. **returned**: the host started again on its disk (its workers by the drill's loop);
   the cancelled task's new run goes on as any other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ratchet.chaos.drill.hostgit import owner_host
from ratchet.chaos.drill.hostloss import (
    CancelThenSubmit,
    Command,
    Episode,
    LossContext,
    snapshot,
)
from ratchet.errors import RatchetError
from ratchet.runtime.state import TERMINAL_PHASES

__all__ = ["GitEpisode", "held_by"]

#: How long the stranded runs of a lost host get to end elsewhere before it comes back.
_GONE_DEADLINE_S = 120.0


def held_by(ctx: LossContext, host: str) -> list[str]:
    """The drill's unfinished runs whose live lease a worker of ``host`` holds."""
    out: list[str] = []
    for run_id in ctx.record.runs:
        if ctx.record.final.get(run_id, ("", ""))[0] == "terminal":
            continue
        try:
            found = ctx.fleet.store.read_run(run_id)
        except RatchetError:
            continue
        if found.lease_live and owner_host(found.owner) == host:
            out.append(run_id)
    return out


@dataclass
class GitEpisode(Episode):
    """One host loss of the git profile (see the module docstring)."""

    retry_target: str | None = None
    operator_host: str = ""

    # -- lost ---------------------------------------------------------------------------

    def lose(self, ctx: LossContext) -> None:
        held = held_by(ctx, self.host)
        self.log["held_at_loss"] = list(held)
        self.log["killed"] = len(ctx.hosts[self.host].lose())
        self.log["lost_at"] = time.time()
        self.log["lost_at_ms"] = ctx.fleet.store.server_time_ms()
        # A lease taken in the moment between the read and the loss is still the dead
        # worker's (it expires, nobody renews it): read again.
        held += [r for r in held_by(ctx, self.host) if r not in held]
        snaps = {r: snapshot(ctx.fleet, r) for r in held}
        ended = {p.value for p in TERMINAL_PHASES}
        self.log["runs"] = {r: s for r, s in snaps.items() if s.get("phase") not in ended}
        self.stage, self.deadline = "gone", time.time() + _GONE_DEADLINE_S
        self._act(ctx)

    def _act(self, ctx: LossContext) -> None:
        faults = ctx.options.faults
        cancelled = {str(c["run_id"]) for c in ctx.record.cancels}
        runs = sorted(
            (r for r in self.log["runs"] if r not in cancelled),
            key=lambda r: ctx.record.runs[r].index,
        )
        others = [h for h, d in ctx.hosts.items() if h != self.host and d.up]
        if not runs or not others:
            self.log.setdefault("errors", []).append("no run stranded or no surviving host")
            return
        self.operator_host = self.rng.choice(others)
        self.log["operator_host"] = self.operator_host
        retried_before = any("retry" in ls for ls in ctx.record.losses if ls is not self.log)
        retry: str | None = None
        if "retry" in faults and (len(runs) > 1 or not retried_before or "cancel" not in faults):
            retry = runs[0]
        cancel = next((r for r in reversed(runs) if r != retry), None)
        if "cancel" in faults and cancel is not None:
            self.log["cancel"] = {"run_id": cancel, "on_host": self.operator_host}
            self.cancel = CancelThenSubmit(
                ctx.record.runs[cancel], self.operator_host, self.log["cancel"]
            )
            ctx.record.cancels.append(self.log["cancel"])
            self.cancel.step(ctx)  # asked right away
        if "retry" in faults and retry is None:
            self.log["retry_skipped"] = "the one stranded run is cancelled instead"
        elif retry is not None:
            self.log["retry"] = {"run_id": retry}
            self.retry_target = retry

    # -- gone ---------------------------------------------------------------------------

    def _gone(self, ctx: LossContext) -> None:
        self._retry(ctx)
        for command in list(self.commands):
            result = command.result()
            if result is not None:
                self.log.setdefault("commands", []).append(result)
                self.commands.remove(command)
        if self.cancel is not None and not self.cancel.done:
            self.cancel.step(ctx)
        self._watch_elsewhere(ctx)
        ended = all(ctx.record.final.get(r, ("", ""))[0] == "terminal" for r in self.log["runs"])
        settled = (
            ended
            and not self.commands
            and self.retry_target is None
            and (self.cancel is None or "command" in self.cancel.log)
        )
        if settled or time.time() > self.deadline:
            if not settled:
                self.log.setdefault("errors", []).append("gone-stage deadline passed")
            self.bring_back(ctx)

    def _retry(self, ctx: LossContext) -> None:
        """Send the retry once the run's lease expired (or it ended, or was taken)."""
        run_id = self.retry_target
        if run_id is None:
            return
        try:
            found = ctx.fleet.store.read_run(run_id)
        except RatchetError:
            return
        live = bool(found.lease_live)
        theirs = live and owner_host(found.owner) == self.host
        ended = ctx.record.final.get(run_id, ("", ""))[0] == "terminal"
        if theirs and not ended and time.time() < self.deadline:
            return  # still the dead worker's lease
        why = ("--reason", "drill: its host was lost")
        self.log["retry"].update(asked_at=time.time(), lease_live_when_asked=live)
        self.commands.append(Command.start(ctx, self.operator_host, "retry", "retry", run_id, *why))
        self.retry_target = None

    def _watch_elsewhere(self, ctx: LossContext) -> None:
        """Note when each stranded run was first seen held by a worker of another host."""
        seen: dict[str, Any] = self.log.setdefault("taken_elsewhere", {})
        for run_id in self.log["runs"]:
            if run_id in seen:
                continue
            try:
                found = ctx.fleet.store.read_run(run_id)
            except RatchetError:
                continue
            host = owner_host(found.owner)
            if found.lease_live and host not in (None, self.host):
                seen[run_id] = {"at": time.time(), "host": host}
