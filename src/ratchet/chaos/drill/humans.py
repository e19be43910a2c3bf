"""People and hosts the drill plays itself: approvers, and workers with skewed clocks.

* ``approvals``: a seeded quarter of the runs need an approval for their order
  (``approval_required: [external_call]``). The drill is their approver: it generates
  Ed25519 keys (the private halves stay in this process, never logged), gives the workers
  a trust file of the public ones, and answers each run waiting in ``awaiting_approval``,
  racing it: first an approval that expires one second after it is signed (it may expire
  before a worker uses it), an approval bound to another intent (stale), and another
  run's approval (wrong run); then valid ones until the run goes on. Once a run consumed
  an approval, the same signed approval is posted again (replayed) through the checked
  path (which must refuse it) and straight into the run's inbox (the worker must), and
  into another waiting run's inbox. Approvers' clocks are skewed too
  (:data:`APPROVERS`): an approver behind signs an expiry that is already past on the
  store's clock, one ahead an expiry later than it meant. Expiry is judged on the store's
  clock whoever signed.
* ``clock-skew``: the first workers start with their wall clock shifted within the bound,
  and one far off (:mod:`ratchet.chaos.drill.skew`).

Everything signed and posted is recorded by nonce and digest in ``record.humans``; the
checks (:mod:`ratchet.chaos.drill.humanchecks`) judge by those identities.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from redis.exceptions import RedisError

from ratchet.chaos.drill.skew import FAR_OFF_S, WORKER_SKEWS_S, skew_env
from ratchet.chaos.drill.workers import DrillWorker, WorkerPool
from ratchet.errors import EvidenceError, RatchetError
from ratchet.fleet.context import Fleet
from ratchet.ops import inspect_run, post_approval
from ratchet.runtime import ApprovalClaims, ApprovalEvidence, Phase, sign_approval
from ratchet.runtime.canonical import model_json

__all__ = ["APPROVERS", "FAR_OFF_NAME", "Humans", "approval_runs"]

#: Approver id -> how far its clock is from the store's (seconds).
APPROVERS = {"drill-approver": 0.0, "drill-approver-ahead": 90.0, "drill-approver-behind": -90.0}
#: The configured name of the worker started far off (not counted as one of the fleet).
FAR_OFF_NAME = "drill-far-off"
_MAX_ROUNDS = 8  # approvals posted to one run before the drill gives up on it
_LONG_TTL_S = 300


def approval_runs(seed: int, runs: int) -> frozenset[int]:
    """The indices of the runs that need an approval: a seeded quarter (at least two)."""
    if runs <= 0:
        return frozenset()
    rng = random.Random(seed + 31)  # noqa: S311 - a reproducible choice, not a secret
    return frozenset(rng.sample(range(runs), min(runs, max(2, runs // 4))))


class Humans:
    """The drill's approvers and skewed hosts. Inactive for faults it was not asked for."""

    def __init__(self, seed: int, runs: int, faults: frozenset[str], folder: Path) -> None:
        self.folder = folder
        self.approving = "approvals" in faults
        self.skewing = "clock-skew" in faults
        self.rng = random.Random(seed + 37)  # noqa: S311 - reproducible, not secret
        self.need_approval = approval_runs(seed, runs) if self.approving else frozenset()
        self._keys = {name: Ed25519PrivateKey.generate() for name in APPROVERS}
        self.approvers_file: Path | None = None
        if self.approving:
            trust = folder / "trust"
            trust.mkdir(parents=True, exist_ok=True)
            self.approvers_file = trust / "approvers.json"
            self.approvers_file.write_text(
                json.dumps(
                    {
                        name: key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
                        for name, key in self._keys.items()
                    }
                )
            )
        self.log: dict[str, Any] = {
            "approval_runs": [],
            "approvals": [],  # every approval signed: run, target, kind, nonce, digest, ...
            "skews": {},  # pid -> seconds
            "far_off": None,
        }
        self._cases: dict[str, dict[str, Any]] = {}  # run -> rounds, last post, replayed
        self._consumed: dict[str, ApprovalEvidence] = {}  # run -> an approval it consumed
        self._evidence: dict[str, ApprovalEvidence] = {}  # nonce -> what was signed
        self._spawned = 0
        self._last_look = 0.0

    def __repr__(self) -> str:
        return f"Humans(approvals={len(self.need_approval)}, skew={self.skewing})"

    # -- skewed workers ---------------------------------------------------------------------

    def spawn(self, pool: WorkerPool, spec: str) -> DrillWorker:
        """Start a worker with ``spec``; the first ones of a clock-skew drill skewed."""
        skew = None
        if self.skewing and self._spawned < len(WORKER_SKEWS_S):
            skew = WORKER_SKEWS_S[self._spawned]
        self._spawned += 1
        if skew is None:
            return pool.spawn(spec)
        worker = pool.spawn(spec, env=skew_env(self.folder, skew))
        self.log["skews"][str(worker.pid)] = skew
        return worker

    def _far_off(self, pool: WorkerPool) -> None:
        if self.skewing and self.log["far_off"] is None:
            worker = pool.spawn("", name=FAR_OFF_NAME, env=skew_env(self.folder, FAR_OFF_S))
            self.log["skews"][str(worker.pid)] = FAR_OFF_S
            self.log["far_off"] = {"pid": worker.pid, "skew_s": FAR_OFF_S, "at": time.time()}

    # -- approvers --------------------------------------------------------------------------

    def tick(
        self,
        fleet: Fleet,
        pool: WorkerPool,
        runs: dict[str, int],
        settled: dict[str, tuple[str, str]],
        skip: set[str],
        ttl_s: float,
    ) -> None:
        """One look at the runs that need an approval (at most every 0.2 s). A run the
        approver still means to answer is taken out of ``settled`` (it is not done)."""
        self._far_off(pool)
        if not self.approving:
            return
        now = time.time()
        if now - self._last_look < 0.2:
            return
        self._last_look = now
        for run_id, index in sorted(runs.items()):
            if index not in self.need_approval or run_id in skip:
                continue
            if run_id not in self.log["approval_runs"]:
                self.log["approval_runs"].append(run_id)
            try:
                self._look(fleet, run_id, runs, settled, max(1.0, 2 * ttl_s))
            except (RatchetError, RedisError):
                continue  # Redis restarting, a run mid-rollback: next look

    def _look(
        self,
        fleet: Fleet,
        run_id: str,
        runs: dict[str, int],
        settled: dict[str, tuple[str, str]],
        cooldown_s: float,
    ) -> None:
        case = self._cases.setdefault(run_id, {"rounds": 0, "last": 0.0, "replayed": False})
        view = inspect_run(fleet, run_id)
        state = view.state
        consumed = set(state.consumed_nonces)
        mine = [a for a in self.log["approvals"] if a["target"] == run_id and a["run"] == run_id]
        used = [a for a in mine if a["nonce"] in consumed]
        if used and not case["replayed"]:
            case["replayed"] = True
            self._replay(fleet, run_id, used[-1]["nonce"], runs)
        waiting = state.phase is Phase.AWAITING_APPROVAL and state.pending is not None
        if not waiting or case["rounds"] >= _MAX_ROUNDS:
            return
        settled.pop(run_id, None)  # the approver still has to answer it
        if view.snapshot.lease_live or time.time() - case["last"] < cooldown_s:
            return
        case["rounds"] += 1
        case["last"] = time.time()
        store_now_s = fleet.store.server_time_ms() // 1000
        if case["rounds"] == 1:
            approver = self.rng.choice(sorted(APPROVERS))
            self._sign_and_post(fleet, view, run_id, approver, 1, "short", store_now_s)
            self._sign_and_post(fleet, view, run_id, "drill-approver", 60, "stale", store_now_s)
            other = self._other_consumed(run_id)
            if other is not None:
                self._post_raw(fleet, run_id, other, "wrong_run")
        else:
            approver = self.rng.choice(["drill-approver", "drill-approver-ahead"])
            self._sign_and_post(fleet, view, run_id, approver, _LONG_TTL_S, "valid", store_now_s)

    def _other_consumed(self, run_id: str) -> ApprovalEvidence | None:
        for other, evidence in sorted(self._consumed.items()):
            if other != run_id:
                return evidence
        return None

    def _sign_and_post(
        self,
        fleet: Fleet,
        view: Any,
        run_id: str,
        approver: str,
        ttl_s: int,
        kind: str,
        store_now_s: int,
    ) -> None:
        """Sign an approval of the pending write as ``approver`` would, with its own
        (skewed) clock, and post it through the checked path; one the check refuses is
        put straight in the inbox, so the worker has to refuse it too."""
        state, pending = view.state, view.state.pending
        env = state.environment
        skew = APPROVERS[approver]
        intent = pending.intent_digest
        if kind == "stale":  # the intent as it was before it was changed: not this one
            intent = hashlib.sha256(b"stale:" + intent.encode()).hexdigest()
        own_now_s = int(time.time() + skew)
        claims = ApprovalClaims(
            task_id=state.task_id,
            run_id=run_id,
            policy_id=state.policy_id,
            policy_version=state.policy_version,
            action_id=pending.action.action_id,
            idempotency_key=pending.action.idempotency_key or "",
            intent_digest=intent,
            env_instance_id=env.instance_id,
            env_fingerprint=env.fingerprint,
            env_version=env.version,
            generation=view.generation,
            nonce=f"ap-drill-{self.rng.getrandbits(64):016x}",
            expires_at=own_now_s + ttl_s,
            max_proposals=state.usage.proposals + 10,
        )
        evidence = sign_approval(self._keys[approver], approver, claims)
        self._evidence[claims.nonce] = evidence
        entry: dict[str, Any] = {
            "run": run_id,
            "target": run_id,
            "kind": kind,
            "approver": approver,
            "approver_skew_s": skew,
            "nonce": claims.nonce,
            "digest": evidence.digest,
            "expires_at": claims.expires_at,
            "signed_store_s": store_now_s,
            "at": time.time(),
        }
        self.log["approvals"].append(entry)
        try:
            post_approval(fleet, run_id, evidence)
            entry["posted"] = "checked"
        except EvidenceError as exc:
            entry["posted"] = "raw"
            entry["post_refused"] = exc.reason or type(exc).__name__
            self._inbox(fleet, run_id, evidence)

    def _inbox(self, fleet: Fleet, run_id: str, evidence: ApprovalEvidence) -> None:
        fleet.store.records.post_evidence(run_id, model_json(evidence))
        fleet.enqueue(run_id)

    def _post_raw(self, fleet: Fleet, target: str, evidence: ApprovalEvidence, kind: str) -> None:
        """Post ``evidence`` (signed for another run, or already consumed) to ``target``:
        first through the checked path, which must refuse it, then into the inbox."""
        entry: dict[str, Any] = {
            "run": evidence.claims.run_id,
            "target": target,
            "kind": kind,
            "approver": evidence.approver_id,
            "approver_skew_s": APPROVERS.get(evidence.approver_id, 0.0),
            "nonce": evidence.claims.nonce,
            "digest": evidence.digest,
            "expires_at": evidence.claims.expires_at,
            "at": time.time(),
        }
        try:
            post_approval(fleet, target, evidence)
            entry["posted"] = "checked"  # the check let it through: the checker sees it
        except EvidenceError as exc:
            entry["post_refused"] = exc.reason or type(exc).__name__
            entry["posted"] = "raw"
        except RatchetError as exc:
            entry["post_refused"] = type(exc).__name__
            entry["posted"] = "raw"
        self.log["approvals"].append(entry)
        self._inbox(fleet, target, evidence)

    def _replay(self, fleet: Fleet, run_id: str, nonce: str, runs: dict[str, int]) -> None:
        """The approval ``run_id`` consumed, posted again to it and to another run that
        needs an approval and has not consumed one yet."""
        evidence = self._evidence.get(nonce)
        if evidence is None:
            return
        self._consumed[run_id] = evidence
        self._post_raw(fleet, run_id, evidence, "replay")
        for other in sorted(runs):
            needs = runs[other] in self.need_approval
            if other != run_id and needs and other not in self._consumed:
                self._post_raw(fleet, other, evidence, "wrong_run")
                break
