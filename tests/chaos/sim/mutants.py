"""Broken builds the simulator must catch: each is one single-point bug, applied only
inside a test (a monkeypatch, or a text substitution on a Lua script as the simulated
Redis compiles it). The product has no switch for any of them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ratchet.chaos.sim.keyspace import Keyspace, SimRedis
from ratchet.chaos.sim.world import Part
from ratchet.runtime import Phase
from ratchet.runtime.effects import Commit, RaiseFence, Verify
from ratchet.runtime.engine import RunEngine
from ratchet.worker import executor
from ratchet.worker import jobprotocol as protocol

Mutant = Callable[[pytest.MonkeyPatch], None]


def _lua(monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    """Compile every script with ``old`` replaced by ``new`` (it must occur)."""
    compile_ = Keyspace.compile

    def mutated(self: Keyspace, source: str) -> Any:
        if old in source:
            source = source.replace(old, new)
        return compile_(self, source)

    monkeypatch.setattr(Keyspace, "compile", mutated)


def fences_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter accepts every fence (the drill's fenceless build): a stale fence is
    accepted and not recorded."""

    def accepts_every_fence(self: Part, fence: Any) -> bool:
        seen = self.fences.get(fence.run_id)
        if seen is not None and fence.key() < seen:
            return True
        self.fences[fence.run_id] = fence.key()
        return True

    monkeypatch.setattr(Part, "check_fence", accepts_every_fence)


def no_intent_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pending intent is not committed before the adapter call: it is held and only
    reaches the store with the next commit (after the write)."""
    commit = RunEngine._commit

    def held(self: RunEngine, new: Any, *, hold: bool = False) -> Any:
        if new.pending is not None and new.pending.receipt is None and new.phase is Phase.RUNNING:
            coalesce, self._coalesce = self._coalesce, True
            try:
                return (yield from commit(self, new, hold=True))
            finally:
                self._coalesce = coalesce
        return (yield from commit(self, new, hold=hold))

    monkeypatch.setattr(RunEngine, "_commit", held)


def commit_id_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """commit.lua forgets commit ids: a retry after a lost reply is a new commit."""
    _lua(
        monkeypatch,
        "local seen = redis.call('HGET', KEYS[5], commit_id)",
        "local seen = false",
    )


def no_guard_before_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor no longer rechecks the lease before an adapter write."""
    monkeypatch.setattr(executor, "_GUARDED", (Commit, RaiseFence, Verify))


def high_water_before_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """commit.lua advances the high-water mark before it validates the commit, so a
    refused commit leaves the mark ahead of the stored checkpoint."""
    _lua(
        monkeypatch,
        "    read_lease()\n    if owner ~= ARGV[1] or version ~= tonumber(ARGV[2]) then\n"
        "      replies[#replies + 1] = {'lease_lost', owner, version, expires, now_ms}\n"
        "      return finish(true)",
        "    read_lease()\n    redis.call('HSET', KEYS[2], 'generation', target)\n"
        "    if owner ~= ARGV[1] or version ~= tonumber(ARGV[2]) then\n"
        "      replies[#replies + 1] = {'lease_lost', owner, version, expires, now_ms}\n"
        "      return finish(true)",
    )


def expiry_on_worker_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease scripts judge expiry on the calling worker's clock, not on the store's
    TIME: the store answers TIME with the caller's host clock."""
    evalsha = SimRedis.evalsha

    def on_the_callers_clock(self: SimRedis, sha: str, numkeys: int, *args: Any) -> Any:
        host = self.host_clock_ms
        if host is None:
            return evalsha(self, sha, numkeys, *args)
        store_clock, self.space.clock_ms = self.space.clock_ms, host
        try:
            return evalsha(self, sha, numkeys, *args)
        finally:
            self.space.clock_ms = store_clock

    monkeypatch.setattr(SimRedis, "evalsha", on_the_callers_clock)


def retry_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job protocol (the code every worker runs) judges a retryable adapter failure
    (a lost reply) as a job error: the run is refused and frozen instead of retried."""
    judged = protocol.step_verdict

    def frozen(exc: BaseException) -> protocol.Verdict:
        verdict = judged(exc)
        return protocol.Verdict.JOB_ERROR if verdict is protocol.Verdict.RETRY else verdict

    monkeypatch.setattr(protocol, "step_verdict", frozen)


def no_reconcile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job protocol steps a restored run without reconciling the write a previous
    owner left pending."""
    monkeypatch.setattr(protocol, "recover", lambda engine: None)


MUTANTS: dict[str, Mutant] = {
    "fences_disabled": fences_disabled,
    "no_intent_commit": no_intent_commit,
    "commit_id_ignored": commit_id_ignored,
    "no_guard_before_write": no_guard_before_write,
    "high_water_before_validation": high_water_before_validation,
    "expiry_on_worker_clock": expiry_on_worker_clock,
    "retry_frozen": retry_frozen,
    "no_reconcile": no_reconcile,
}


@contextlib.contextmanager
def applied(name: str) -> Iterator[None]:
    """Apply mutant ``name`` for the duration of the block (outside pytest's fixture)."""
    patch = pytest.MonkeyPatch()
    try:
        MUTANTS[name](patch)
        yield
    finally:
        patch.undo()
