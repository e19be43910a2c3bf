"""The job protocol's policy, judged without a fleet: how each failure ends a job, what a
refusal records and releases, and that the outcome names are the metrics' labels.

The flow itself runs end to end in every fleet test (the RQ job drives it) and in the
simulator (its workers drive it; ``tests/chaos/sim/test_mutants.py`` plants bugs here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from ratchet.errors import (
    AdapterError,
    CheckpointError,
    CommitOutcomeUnknownError,
    ConfigurationError,
    ContractError,
    EnvironmentMismatchError,
    FenceRejectedError,
    HighWaterUnavailableError,
    IntegrityError,
    LeaseLostError,
    RatchetError,
    ReviewDecisionError,
    RunNotFoundError,
    StoreUnavailableError,
)
from ratchet.fleet.metrics import JOB_OUTCOMES
from ratchet.worker.jobprotocol import (
    JobOutcome,
    JobReport,
    Verdict,
    refuse,
    restore_verdict,
    step_verdict,
)


def test_every_outcome_is_a_metric_label() -> None:
    assert set(JOB_OUTCOMES) - {"other"} == {o.value for o in JobOutcome}


def _unreadable(cause: BaseException) -> IntegrityError:
    """A restore's refusal because no high-water mark could be read, for ``cause`` (as
    ``leasing.handle`` raises it: ``from`` the store's error)."""
    high_water = HighWaterUnavailableError("x", cause=type(cause).__name__)
    high_water.__cause__ = cause
    exc = IntegrityError("no high water")
    exc.__context__ = high_water
    return exc


@pytest.mark.parametrize(
    ("exc", "verdict"),
    [
        (CheckpointError("bad mac", reason="mac"), Verdict.REFUSE),
        (_unreadable(StoreUnavailableError("down")), Verdict.LOST),
        (_unreadable(RunNotFoundError("gone")), Verdict.REFUSE),
        (FenceRejectedError("newer fence seen"), Verdict.REFUSE),
        (ConfigurationError("no such agent"), Verdict.REFUSE),
        (ContractError("bad document"), Verdict.REFUSE),
        (ReviewDecisionError("bad decision"), Verdict.REFUSE),
        (AdapterError("server down", retryable=True), Verdict.RETRY),
        (AdapterError("cannot build", retryable=False), Verdict.REFUSE),
        (LeaseLostError("gone"), None),
        (StoreUnavailableError("down"), None),
        (ValueError("agent bug"), None),
    ],
)
def test_how_a_restore_failure_ends_the_job(exc: BaseException, verdict: Verdict | None) -> None:
    assert restore_verdict(exc) is verdict


@pytest.mark.parametrize(
    ("exc", "verdict"),
    [
        (LeaseLostError("gone"), Verdict.LOST),
        (FenceRejectedError("newer fence seen"), Verdict.LOST),
        (CommitOutcomeUnknownError("reply lost"), Verdict.LOST),
        (StoreUnavailableError("down"), Verdict.LOST),
        (EnvironmentMismatchError("edited behind the run"), Verdict.ENVIRONMENT),
        (AdapterError("reply lost", retryable=True), Verdict.RETRY),
        (AdapterError("refused for good", retryable=False), Verdict.JOB_ERROR),
        (ContractError("agent proposed garbage"), Verdict.JOB_ERROR),
        (ValueError("agent bug"), Verdict.JOB_ERROR),
    ],
)
def test_how_a_step_failure_ends_the_job(exc: BaseException, verdict: Verdict) -> None:
    assert step_verdict(exc) is verdict


@dataclass
class _Lease:
    released: list[bool] = field(default_factory=list)
    refuse_release: RatchetError | None = None

    def release(self, *, reap: bool = False) -> None:
        if self.refuse_release is not None:
            raise self.refuse_release
        self.released.append(reap)


@dataclass
class _Guard:
    stopped: bool = False

    def stop(self) -> None:
        self.stopped = True


@dataclass
class _Host:
    """The parts of a host that a refusal uses."""

    gone: bool = False
    record_fails: RatchetError | None = None
    records: list[tuple[str, str]] = field(default_factory=list)
    lease: _Lease = field(default_factory=_Lease)
    guard: _Guard = field(default_factory=_Guard)

    def lease_gone(self) -> bool:
        return self.gone

    def record_refusal(self, kind: JobOutcome, reason: str, exc: RatchetError) -> None:
        if self.record_fails is not None:
            raise self.record_fails
        self.records.append((kind.value, reason))


def _refuse(host: _Host) -> JobReport:
    report = JobReport("r1", JobOutcome.LEASE_LOST)
    exc = CheckpointError("checkpoint MAC does not verify", reason="mac")
    refuse(host, report, exc, JobOutcome.RESTORE_REFUSED)  # type: ignore[arg-type]
    return report


def test_a_refusal_is_recorded_then_released_off_the_index() -> None:
    host = _Host()
    report = _refuse(host)
    assert report.outcome is JobOutcome.RESTORE_REFUSED
    assert report.detail == "mac: checkpoint MAC does not verify"
    assert host.records == [("restore_refused", "mac")]
    assert host.guard.stopped and host.lease.released == [False]


def test_a_refusal_under_a_lease_no_longer_ours_records_nothing() -> None:
    host = _Host(gone=True)
    report = _refuse(host)
    assert report.outcome is JobOutcome.LEASE_LOST
    assert host.records == [] and host.lease.released == []


def test_a_refusal_the_store_did_not_record_is_not_released() -> None:
    """Released off the index with no incident, the run would sit frozen with nothing to
    say why; kept on the index, its lease expires and the next job refuses it again, and
    records it."""
    host = _Host(record_fails=StoreUnavailableError("down"))
    report = _refuse(host)
    assert report.outcome is JobOutcome.LEASE_LOST
    assert "not recorded" in report.detail
    assert host.lease.released == []


def test_a_refusal_whose_release_is_refused_ends_as_a_lost_lease() -> None:
    host = _Host()
    host.lease.refuse_release = LeaseLostError("expired meanwhile")
    report = _refuse(host)
    assert report.outcome is JobOutcome.LEASE_LOST
    assert host.records == [("restore_refused", "mac")]


def test_report_as_dict_is_plain_json_data() -> None:
    data: dict[str, Any] = JobReport("r1", JobOutcome.YIELDED, steps=3).as_dict()
    assert data["outcome"] == "yielded" and type(data["outcome"]) is str
