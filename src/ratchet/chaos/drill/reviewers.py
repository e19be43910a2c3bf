"""Reviewers the drill plays: conflicts planted behind runs' backs, and decisions signed
while the environment moves.

``reviews``: a seeded few runs (:func:`review_runs`; never an approval run) meet, at their
order, an order another client of the orders API already placed under the very
idempotency key the run will derive for it (:func:`ratchet.runtime.derive_idempotency_key`
of the order's plan position), for another body. It is planted in the run's own tenant
before the run is created, so the run's environment holds it from the start. The run's
order then conflicts (the service answers 422 with the other order's receipt) and the run
freezes in ``needs_review`` (``intent_conflict``) with nothing sent in its name.

The drill is their reviewer (an Ed25519 key it generates; the private half never leaves
this process; the workers get a trust file of the public half). For each such run waiting
in review with its lease released:

1. it moves the run's environment (one more foreign order in the tenant), then signs a
   decision bound to the case's environment as it was before the move (``stale``) and
   posts it through the checked path (which cannot see the environment): the worker must
   refuse it (``environment_changed``, an ``evidence_refused`` incident) and leave the
   case open;
2. once that refusal is on record, or after :data:`_STALE_PATIENCE_S`, it decides for the
   environment as it is now, through ``ratchet.ops.review`` (``ratchet review``):
   ``replan`` (the key is quarantined; the run places its own order under a new key and
   completes) or ``abort`` (the run ends failed), seeded per run; again after
   :data:`_STALE_PATIENCE_S` if the run did not consume it, at most :data:`_MAX_ROUNDS`;
3. once the run consumed it, the same signed decision is posted again (``replay``): the
   checked path must refuse it, and the worker must ignore it in the inbox.

Every order planted and every decision signed is recorded in ``record.reviews`` by key
and nonce; the checks (:mod:`ratchet.chaos.drill.reviewchecks`) judge by those
identities.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import random
import secrets
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from redis.exceptions import RedisError

from ratchet.chaos.drill.services import plan
from ratchet.errors import ConfigurationError, EvidenceError, RatchetError
from ratchet.fleet.context import Fleet
from ratchet.ops import inspect_run, post_review_decision, review, review_claims
from ratchet.runtime import (
    ReviewDecision,
    ReviewReason,
    ReviewVerdict,
    derive_idempotency_key,
    sign_review_decision,
)
from ratchet.runtime.canonical import model_json

__all__ = ["REVIEWER", "Reviewers", "foreign_body", "order_key", "review_runs"]

REVIEWER = "drill-reviewer"
_STALE_PATIENCE_S = 20.0  # how long the stale decision may wait for a worker's refusal
_MAX_ROUNDS = 4  # fresh decisions signed for one case before the drill gives up on it
_POKE_S = 4.0  # the run is enqueued again while the stale decision waits this long
_ORDER_POSITION = next(i for i, s in enumerate(plan(0)) if s["kind"] == "external_call")


def review_runs(seed: int, runs: int, exclude: frozenset[int]) -> frozenset[int]:
    """The indices of the runs that meet a planted conflict: two (one for fewer than eight
    runs) of the runs between a sixteenth and a quarter of the way (decided well before
    the rollback at 45 % of the runs settled, which would rewind a review in flight),
    never one in ``exclude`` (the approval runs)."""
    pool = [i for i in range(runs // 16, max(runs // 4, 2)) if i not in exclude]
    rng = random.Random(seed + 41)  # noqa: S311 - a reproducible choice, not a secret
    return frozenset(rng.sample(pool, min(len(pool), 2 if runs >= 8 else 1)))


def order_key(run_id: str) -> str:
    """The idempotency key the run derives for its order (before any replan)."""
    return derive_idempotency_key(run_id, _ORDER_POSITION, salt="0")


def foreign_body(index: int, n: int) -> str:
    """Another client's order body (``n``-th) in run ``index``'s tenant."""
    return f'{{"qty":{n + 2},"run":{index},"sku":"foreign-{index}-{n}"}}'


def _place(url: str, key: str, body: str) -> int:
    """Place an order at the tenant ``url`` as another client would (its own run id and
    fence, no store epoch). Returns the HTTP status. Raises OSError."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10)
    data = body.encode()
    try:
        conn.request(
            "POST",
            parts.path.rstrip("/") + "/v1/orders",
            body=data,
            headers={
                "Content-Type": "application/json",
                "Idempotency-Key": key,
                "Ratchet-Run-Id": "drill-foreign-client",
                "Ratchet-Lease-Version": "1",
                "Ratchet-State-Version": "1",
                "Ratchet-Intent-Digest": hashlib.sha256(data).hexdigest(),
            },
        )
        response = conn.getresponse()
        response.read()
        return int(response.status)
    finally:
        conn.close()


class Reviewers:
    """The drill's reviewer. Inactive unless ``reviews`` was asked for."""

    def __init__(
        self, seed: int, runs: int, faults: frozenset[str], folder: Path, exclude: frozenset[int]
    ) -> None:
        self.active = "reviews" in faults
        self.rng = random.Random(seed + 43)  # noqa: S311 - reproducible, not secret
        self.need_review = review_runs(seed, runs, exclude) if self.active else frozenset()
        self._key = Ed25519PrivateKey.generate()
        self.reviewers_file: Path | None = None
        if self.active:
            trust = folder / "trust"
            trust.mkdir(parents=True, exist_ok=True)
            self.reviewers_file = trust / "reviewers.json"
            public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
            self.reviewers_file.write_text(json.dumps({REVIEWER: public}))
        self.log: dict[str, Any] = {
            "runs": {},  # run -> index, verdict, planted key, tenant url
            "foreign_keys": [],  # every key another client used in a review run's tenant
            "decisions": [],  # every decision signed or posted: run, kind, nonce, ...
            "env_moves": [],
        }
        self._cases: dict[str, dict[str, Any]] = {}
        self._signed: dict[str, ReviewDecision] = {}  # nonce -> decision
        self._last_look = 0.0

    def __repr__(self) -> str:
        return f"Reviewers(runs={sorted(self.need_review)})"

    def plant(self, run_id: str, index: int, url: str) -> None:
        """Before run ``index`` is created: another client's order under its order key.
        Raises ConfigurationError when the service refuses it (the drill cannot go on)."""
        if index not in self.need_review:
            return
        key = order_key(run_id)
        status = _place(url, key, foreign_body(index, 0))
        if status not in (200, 201):
            raise ConfigurationError("the orders service refused a planted order", status=status)
        verdict = ReviewVerdict.ABORT if len(self.log["runs"]) % 2 else ReviewVerdict.REPLAN
        self.log["runs"][run_id] = {
            "index": index,
            "key": key,
            "url": url,
            "verdict": verdict.value,
            "planted_at": time.time(),
        }
        self.log["foreign_keys"].append(key)

    def tick(
        self,
        fleet: Fleet,
        settled: dict[str, tuple[str, str]],
        skip: set[str],
        enqueued: dict[str, int],
    ) -> None:
        """One look at the review runs (at most every 0.2 s). A run the reviewer still
        means to answer is taken out of ``settled`` (it is not done)."""
        if not self.active:
            return
        now = time.time()
        if now - self._last_look < 0.2:
            return
        self._last_look = now
        for run_id in sorted(self.log["runs"]):
            if run_id in skip or run_id not in enqueued:
                continue
            try:
                self._look(fleet, run_id, settled, now)
            except (RatchetError, RedisError, OSError):
                continue  # Redis restarting, a run mid-rollback, the service restarting

    def _look(
        self, fleet: Fleet, run_id: str, settled: dict[str, tuple[str, str]], now: float
    ) -> None:
        case = self._cases.setdefault(run_id, {"stage": "planted", "rounds": 0, "at": 0.0})
        view = inspect_run(fleet, run_id)
        state = view.state
        if case["stage"] == "decided" and case["nonce"] in state.consumed_nonces:
            self._replay(fleet, run_id, case)
            return
        open_case = state.review
        if (
            open_case is None
            or open_case.reason is not ReviewReason.INTENT_CONFLICT
            or view.snapshot.lease_live
        ):
            return
        settled.pop(run_id, None)  # the reviewer still has to answer it
        if case["stage"] == "planted":
            self._stale(fleet, run_id, view, case, now)
        elif case["stage"] == "stale_posted":
            refused = self._refusals(fleet, run_id) > case["refusals_before"]
            if refused or now - case["at"] > _STALE_PATIENCE_S:
                case["stale_refusal_seen"] = refused
                self._decide(fleet, run_id, case, now)
            elif now - case.get("poked", case["at"]) > _POKE_S:
                # No worker has looked yet (its job lost with a killed worker or Redis):
                # enqueued again, as an operator would.
                fleet.enqueue(run_id)
                case["poked"] = now
        elif (
            case["stage"] == "decided"
            and now - case["at"] > _STALE_PATIENCE_S
            and case["rounds"] < _MAX_ROUNDS
        ):
            self._decide(fleet, run_id, case, now)

    @staticmethod
    def _refusals(fleet: Fleet, run_id: str) -> int:
        return sum(
            1
            for i in fleet.store.records.incidents(run_id)
            if i.get("kind") == "evidence_refused" and i.get("reason") == "environment_changed"
        )

    def _stale(
        self, fleet: Fleet, run_id: str, view: Any, case: dict[str, Any], now: float
    ) -> None:
        """Move the environment, then sign for it as it was: the worker must refuse."""
        info = self.log["runs"][run_id]
        open_case, state = view.state.review, view.state
        case["case_id"] = open_case.case_id
        case["refusals_before"] = self._refusals(fleet, run_id)
        key = f"drill-move-{secrets.token_hex(6)}"
        status = _place(info["url"], key, foreign_body(info["index"], 1 + len(self._moves(run_id))))
        self.log["foreign_keys"].append(key)
        self.log["env_moves"].append({"run": run_id, "key": key, "status": status, "at": now})
        env = open_case.environment  # as it was when the case opened: before the move
        claims = review_claims(
            state,
            open_case,
            environment=env,
            verdict=ReviewVerdict(info["verdict"]),
            nonce=f"rv-drill-{self.rng.getrandbits(64):016x}",
        )
        decision = sign_review_decision(self._key, REVIEWER, claims)
        entry = self._entry(run_id, "stale", decision)
        entry["env_version"] = env.version
        try:
            post_review_decision(fleet, run_id, decision)
            entry["posted"] = "checked"
        except EvidenceError as exc:
            entry["posted"] = "raw"
            entry["post_refused"] = exc.reason or type(exc).__name__
            fleet.store.records.post_evidence(run_id, model_json(decision))
            fleet.enqueue(run_id)
        case.update(stage="stale_posted", at=now, stale_nonce=claims.nonce)

    def _moves(self, run_id: str) -> list[dict[str, Any]]:
        return [m for m in self.log["env_moves"] if m["run"] == run_id]

    def _decide(self, fleet: Fleet, run_id: str, case: dict[str, Any], now: float) -> None:
        """Decide for the environment as it is now, as ``ratchet review`` does."""
        case["rounds"] += 1
        verdict = self.log["runs"][run_id]["verdict"]
        try:
            posted = review(fleet, run_id, verdict, key=self._key, reviewer_id=REVIEWER)
        except EvidenceError as exc:
            self.log["decisions"].append(
                {
                    "run": run_id,
                    "kind": "fresh",
                    "refused": exc.reason or "",
                    "at": now,
                }
            )
            return
        decision = posted.evidence
        if not isinstance(decision, ReviewDecision):
            return
        entry = self._entry(run_id, "fresh", decision)
        entry["env_version"] = decision.claims.env_version
        entry["stale_refusal_seen"] = case.get("stale_refusal_seen")
        entry["posted"] = "checked"
        case.update(stage="decided", at=now, nonce=decision.claims.nonce)

    def _replay(self, fleet: Fleet, run_id: str, case: dict[str, Any]) -> None:
        """The decision the run consumed, posted again: checked (refused), then raw."""
        decision = self._signed[case["nonce"]]
        entry = self._entry(run_id, "replay", decision)
        try:
            post_review_decision(fleet, run_id, decision)
            entry["posted"] = "checked"  # the check let it through: the checker sees it
        except EvidenceError as exc:
            entry["posted"] = "raw"
            entry["post_refused"] = exc.reason or type(exc).__name__
        fleet.store.records.post_evidence(run_id, model_json(decision))
        fleet.enqueue(run_id)
        case["stage"] = "replayed"

    def _entry(self, run_id: str, kind: str, decision: ReviewDecision) -> dict[str, Any]:
        self._signed[decision.claims.nonce] = decision
        entry: dict[str, Any] = {
            "run": run_id,
            "kind": kind,
            "nonce": decision.claims.nonce,
            "case_id": decision.claims.case_id,
            "verdict": decision.claims.verdict.value,
            "at": time.time(),
        }
        self.log["decisions"].append(entry)
        return entry
