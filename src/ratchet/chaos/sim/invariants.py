"""The invariants, judged as the simulation runs: after every store script, at every write
an adapter part performs, at every lease-guard check, and once at the end.

The judge keeps its own truth beside the store's: the lease as a correct store would hold
it, judged on the simulation's true store clock (who holds it, which version, until when).
The scripts' own answers are checked against it, so a script that judged expiry by
another clock, or a store that moved its high-water mark alone, is caught at the call.

==================================  ======================================================
invariant                           violated when
==================================  ======================================================
``one_effect_per_intent``           a part performs a second effect for a key or intent
``high_water_never_goes_back``      the store's generation decreases
``checkpoint_moves_with_high_water`` the generation moves without its checkpoint and
                                    history entry (they move in one step)
``acked_checkpoint_kept``           a commit a worker saw succeed is not in the history
                                    at its generation
``no_restore_below_an_ack``         a restore under lease L is below an ack made under an
                                    earlier lease
``no_stale_commit``                 a commit applied while its lease was not live (true
                                    store clock), or history lease versions not monotonic
``leases_on_the_store_clock``       a lease taken over, or renewed, against the true
                                    store clock; a guard that passed on a dead lease
``no_stale_write``                  a part accepted a write under a fence lower than one
                                    it accepted before, or from a worker whose lease was
                                    not live and whose guard had not cleared this very call
``intent_committed_before_effect``  a part performed a write whose pending intent was not
                                    in the store's current checkpoint
``commit_replies_truthful``         the store refused a commit it had applied, or
                                    acknowledged one it had not
``terminal_stays_terminal``         a commit applied after the run's checkpoint was
                                    terminal
``no_unexplained_refusal``          a worker failed a restore closed, or froze the run,
                                    with no tampering in the world to explain it
``no_unexpected_error``             a job raised something that is not a ratchet error
``run_finishes``                    the run did not complete once the faults stopped, or
                                    its receipts differ from the parts' effects
==================================  ======================================================
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ratchet.leasing.encoding import decode_checkpoint
from ratchet.leasing.keyspace import run_keys
from ratchet.runtime.actions import Action
from ratchet.runtime.checkpoint import CheckpointPayload
from ratchet.runtime.restore import open_checkpoint
from ratchet.runtime.signing import KeyRing, open_envelope
from ratchet.runtime.state import TERMINAL_PHASES, RunState

from .keyspace import Audit, Keyspace
from .world import Effect, Part

__all__ = ["INVARIANTS", "Judge", "Lease", "Violation"]

INVARIANTS = (
    "one_effect_per_intent",
    "high_water_never_goes_back",
    "checkpoint_moves_with_high_water",
    "acked_checkpoint_kept",
    "no_restore_below_an_ack",
    "no_stale_commit",
    "leases_on_the_store_clock",
    "no_stale_write",
    "intent_committed_before_effect",
    "commit_replies_truthful",
    "terminal_stays_terminal",
    "no_unexplained_refusal",
    "no_unexpected_error",
    "run_finishes",
)

_TERMINAL = frozenset(p.value.encode() for p in TERMINAL_PHASES)


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    detail: str
    seq: int


@dataclass
class Lease:
    """The lease as a correct store holds it, on the true store clock."""

    owner: str = ""
    version: int = 0
    expires_ms: int = 0

    def live_for(self, owner: str, version: int, now_ms: int) -> bool:
        return self.owner == owner and self.version == version and now_ms < self.expires_ms


@dataclass
class Judge(Audit):
    """Truth and verdicts of one schedule (see the module docstring)."""

    space: Keyspace
    run_id: str
    keyring: KeyRing
    now_ms: Callable[[], int]  # the true store clock
    seq: Callable[[], int]
    lease: Lease = field(default_factory=Lease)
    violations: list[Violation] = field(default_factory=list)
    acks: list[tuple[int, int, str]] = field(default_factory=list)  # lease, generation, digest
    restores: list[tuple[int, int]] = field(default_factory=list)  # lease, generation
    high_water: int = 0
    terminal_at: int | None = None

    applied_ids: dict[bytes, bytes] = field(default_factory=dict)  # commit id -> digest

    def __post_init__(self) -> None:
        keys = run_keys(self.run_id)
        self._state = keys.state.encode()
        self._history = keys.history.encode()
        self._ckpt = keys.ckpt.encode()
        self._archive = keys.archive.encode()
        self._ckpt_seen: bytes | None = None
        self._history_len = 0
        self._decoded: tuple[bytes, RunState] | None = None
        self._head: tuple[bytes, RunState] | None = None

    def fail(self, invariant: str, detail: str) -> None:
        self.violations.append(Violation(invariant, detail, self.seq()))

    @property
    def failed(self) -> bool:
        return bool(self.violations)

    # -- the store ---------------------------------------------------------------------------

    def before(self, name: str, keys: list[bytes], args: list[bytes]) -> Any:
        return Lease(self.lease.owner, self.lease.version, self.lease.expires_ms)

    def after(
        self, token: Any, name: str, keys: list[bytes], args: list[bytes], reply: Any
    ) -> None:
        was: Lease = token
        now = self.now_ms()
        if name == "acquire_lease" and reply and reply[0] == b"acquired":
            owner = args[0].decode()
            if was.owner and was.owner != owner and now < was.expires_ms:
                self.fail(
                    "leases_on_the_store_clock",
                    f"{owner} took over a lease {was.owner} held until {was.expires_ms} "
                    f"at store time {now}",
                )
            self.lease = Lease(owner, int(reply[1]), now + int(args[1]))
        elif name == "renew_lease" and reply and reply[0] == b"renewed":
            owner, version = args[0].decode(), int(args[1])
            if not was.live_for(owner, version, now):
                self.fail(
                    "leases_on_the_store_clock",
                    f"{owner} renewed lease {version} at store time {now}, but it was "
                    f"{was.owner or 'free'}'s (version {was.version}) until {was.expires_ms}",
                )
            self.lease = Lease(owner, version, now + int(args[2]))
        elif name == "release_lease" and reply and reply[0] == b"released":
            self.lease.owner = ""
        elif name == "commit" and isinstance(reply, list):
            owner, version = args[0].decode(), int(args[1])
            self._check_commit_ids(args, reply)
            for entry in reply:
                if entry and entry[0] == b"committed" and not was.live_for(owner, version, now):
                    self.fail(
                        "no_stale_commit",
                        f"generation {entry[1]} committed under {owner}'s lease {version} at "
                        f"store time {now}; the live lease was {was.owner or 'none'} "
                        f"{was.version} until {was.expires_ms}",
                    )
                elif entry and entry[0] == b"released":
                    self.lease.owner = ""
        if name in ("commit", "create_run"):
            self.check_store()

    def _check_commit_ids(self, args: list[bytes], reply: list[Any]) -> None:
        """Each commit's entry against the truth of its id: a commit id applied before
        answers ``already_applied`` (a retry after a lost reply), a new one never does."""
        groups, at = [], 7
        for _ in range(int(args[4])):
            groups.append((args[at + 2], args[at + 3]))
            at += 9 + int(args[at + 8])
        for (commit_id, digest), entry in zip(groups, reply, strict=False):
            status = entry[0] if entry else b""
            if status in (b"phase", b"released"):
                break
            seen = self.applied_ids.get(commit_id)
            if seen is not None and seen == digest and status != b"already_applied":
                self.fail(
                    "commit_replies_truthful",
                    f"commit {commit_id.decode()} was applied before; its retry was answered "
                    f"{status.decode()}",
                )
            elif seen is None and status == b"already_applied":
                self.fail(
                    "commit_replies_truthful",
                    f"commit {commit_id.decode()} answered already_applied, never applied",
                )
            if status == b"committed":
                self.applied_ids[commit_id] = digest

    def history(self) -> list[bytes]:
        entries = self.space.data.get(self._history)
        return list(entries) if entries else []

    def check_store(self) -> None:
        state = self.space.data.get(self._state)
        if not state:
            return
        generation = int(state[b"generation"])
        if generation < self.high_water:
            self.fail("high_water_never_goes_back", f"generation {generation} < {self.high_water}")
        self.high_water = max(self.high_water, generation)
        history = self.space.data.get(self._history) or []
        top = history[0].split(b"|") if history else []
        ckpt = self.space.data.get(self._ckpt)
        if not top or int(top[0]) != generation:
            self.fail(
                "checkpoint_moves_with_high_water",
                f"high-water mark {generation}, newest history entry "
                f"{top[0].decode() if top else 'none'}",
            )
        elif ckpt is not self._ckpt_seen and ckpt is not None:
            raw = decode_checkpoint(ckpt, max_bytes=1 << 24)
            if hashlib.sha256(raw).hexdigest().encode() != top[5]:
                self.fail(
                    "checkpoint_moves_with_high_water",
                    f"the stored checkpoint is not generation {generation}'s",
                )
            self._ckpt_seen = ckpt
        fresh = len(history) - self._history_len
        for i in range(min(fresh, len(history) - 1)):
            newer, older = int(history[i].split(b"|")[2]), int(history[i + 1].split(b"|")[2])
            if newer < older:
                self.fail(
                    "no_stale_commit",
                    f"history: a commit under lease {newer} after one under lease {older}",
                )
        self._history_len = len(history)
        phase = state.get(b"phase", b"")
        if self.terminal_at is not None and generation != self.terminal_at:
            self.fail(
                "terminal_stays_terminal",
                f"generation {generation} committed after the run ended at {self.terminal_at}",
            )
        elif phase in _TERMINAL and self.terminal_at is None:
            self.terminal_at = generation
        self.check_acks(history)

    def check_acks(self, history: list[bytes]) -> None:
        length = len(history)
        # Generations are consecutive from 1, newest first: generation g sits at
        # length - g. Only when that does not hold is the history read whole.
        if all(
            0 <= length - g < length
            and history[length - g].startswith(b"%d|" % g)
            and history[length - g].split(b"|")[5].decode() == d
            for _, g, d in self.acks
        ):
            return
        by_generation = {int(e.split(b"|")[0]): e.split(b"|")[5].decode() for e in history}
        for version, generation, digest in self.acks:
            if by_generation.get(generation) != digest:
                self.fail(
                    "acked_checkpoint_kept",
                    f"generation {generation} acknowledged under lease {version} is gone "
                    f"(history holds {by_generation.get(generation, 'nothing')[:12]})",
                )
                return

    def applied(self, generation: int, blob: bytes) -> bool:
        digest = hashlib.sha256(blob).hexdigest().encode()
        for entry in self.space.data.get(self._history) or ():
            fields = entry.split(b"|")
            if int(fields[0]) == generation:
                return bool(fields[5] == digest)
        return False

    def acked(self, lease_version: int, generation: int, blob: bytes) -> None:
        self.acks.append((lease_version, generation, hashlib.sha256(blob).hexdigest()))
        self.check_acks(self.history())

    def restored(self, lease_version: int, generation: int) -> None:
        self.restores.append((lease_version, generation))
        for version, acked, _ in self.acks:
            if version < lease_version and acked > generation:
                self.fail(
                    "no_restore_below_an_ack",
                    f"restore at generation {generation} under lease {lease_version}; "
                    f"generation {acked} was acknowledged under lease {version}",
                )
                return

    def stored_head(self) -> RunState | None:
        """The head of the run state in the store's current checkpoint (None: no run):
        authentic (its MAC checked) and schema-valid, its trace and executed writes left in
        the archive. What a write's check needs (the pending write) at the cost of one
        parse, not of the whole archive's."""
        ckpt = self.space.data.get(self._ckpt)
        if ckpt is None:
            return None
        if self._head is None or self._head[0] is not ckpt:
            raw = decode_checkpoint(ckpt, max_bytes=1 << 24)
            body = open_envelope(self.keyring, raw)
            self._head = (ckpt, CheckpointPayload.model_validate_json(body).state)
        return self._head[1]

    def stored_state(self) -> RunState | None:
        """The run state in the store's current checkpoint, its whole history read from
        the archive and checked (None: no run)."""
        ckpt = self.space.data.get(self._ckpt)
        if ckpt is None:
            return None
        if self._decoded is None or self._decoded[0] is not ckpt:
            raw = decode_checkpoint(ckpt, max_bytes=1 << 24)
            archive = tuple(self.space.data.get(self._archive) or ())
            state = open_checkpoint(raw, keyring=self.keyring, archive=archive).state
            self._decoded = (ckpt, state)
        return self._decoded[1]

    # -- the parts ---------------------------------------------------------------------------

    def write(
        self,
        part: Part,
        effect: Effect,
        before: tuple[int, int] | None,
        action: Action,
        *,
        live: bool,
        cleared: bool,
        writer_blob: bytes | None = None,
    ) -> None:
        """Judge one write a part performed (``live``: the writer's lease is live on the
        true store clock now; ``cleared``: its guard passed for this very call while it
        was; ``writer_blob``: the checkpoint the writer's engine stands on)."""
        same = [
            e
            for e in part.effects
            if e.key == effect.key or e.intent_digest == effect.intent_digest
        ]
        if len(same) > 1:
            self.fail("one_effect_per_intent", f"a second {part.name} effect for {effect.key}")
        if before is not None and effect.fence < before:
            self.fail(
                "no_stale_write",
                f"the {part.name} part accepted {effect.writer}'s write under fence "
                f"{effect.fence} after accepting {before}",
            )
        elif not (live or cleared):
            self.fail(
                "no_stale_write",
                f"the {part.name} part accepted {effect.writer}'s write under lease "
                f"{effect.fence[0]}, which was not live and whose guard had not cleared it",
            )
        history = self.space.data.get(self._history) or ()
        if writer_blob is not None and history:
            top = history[0].split(b"|")[5]
            if hashlib.sha256(writer_blob).hexdigest().encode() == top:
                # The store's checkpoint is the writer's own: its pending write is the one
                # being sent (the engine sends nothing else), so no decoding is needed.
                return
        state = self.stored_head()
        pending = state.pending if state is not None else None
        if (
            pending is None
            or pending.action.idempotency_key != effect.key
            or pending.intent_digest != effect.intent_digest
        ):
            held = "no pending write" if pending is None else pending.action.idempotency_key
            self.fail(
                "intent_committed_before_effect",
                f"{effect.writer} wrote {effect.key} to {part.name}; the store's checkpoint "
                f"holds {held}",
            )
