"""The adapter conformance suite, run against the in-memory workspace, the workspace
adapter, the HTTP adapter on the reference service, the router over both, and the git
workspace over file://, git daemon and smart HTTP."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from dulwich.repo import Repo

from ratchet.adapters import HttpAdapter, RouterAdapter, WorkspaceAdapter
from ratchet.adapters.gitremote import RemoteBranch
from ratchet.adapters.gitworkspace import GitWorkspaceAdapter
from ratchet.errors import ConformanceError
from ratchet.runtime import Action, Fence
from ratchet.testing.conformance import (
    CHECKS,
    ConformanceCheck,
    ConformanceSubject,
    run_check,
    run_conformance,
)
from ratchet.testing.memory import ManualClock, MemoryWorkspace
from tests.adapters.conftest import ServiceBox
from tests.adapters.harness import make_workspace
from tests.gitremotes import NO_GIT, GitDaemon, GitHttp, make_bare, push_foreign, writes_by_key


def file_write(key: str, variant: int, expected: int) -> Action:
    return Action.model_validate(
        {
            "action_id": f"a-{key}-{variant}",
            "kind": "write_file",
            "risk": "reversible_write",
            "args": {"path": "app.py", "content": f"print({variant})\n"},
            "idempotency_key": key,
            "expected_env_version": expected,
            "deadline_at": 2**40,
        }
    )


def order_call(key: str, variant: int, expected: int) -> Action:
    return Action.model_validate(
        {
            "action_id": f"a-{key}-{variant}",
            "kind": "external_call",
            "risk": "irreversible_external_write",
            "args": {"operation": "place-order", "body": f'{{"sku":"A-{variant}","qty":1}}'},
            "idempotency_key": key,
            "expected_env_version": expected,
            "deadline_at": 2**40,
        }
    )


def memory_subject(clock: ManualClock) -> ConformanceSubject:
    ws = MemoryWorkspace("mem-1", {"app.py": "x\n"}, clock=clock)
    return ConformanceSubject(
        adapter=ws,
        make_write=file_write,
        effects=lambda: ws.write_count,
        drift=lambda: ws.external_edit("app.py", "edited\n"),
    )


def workspace_subject(root: Path, clock: ManualClock) -> ConformanceSubject:
    make_workspace(root)
    handles: list[WorkspaceAdapter] = []

    def open_handle() -> WorkspaceAdapter:
        handles.append(WorkspaceAdapter(root, ["app.py", "tests"], clock=clock))
        return handles[-1]

    ws = open_handle()

    def close() -> None:
        for handle in handles:
            handle.close()

    return ConformanceSubject(
        adapter=ws,
        make_write=file_write,
        effects=lambda: ws.effects,
        reopen=open_handle,
        close=close,
        drift=lambda: (root / "app.py").write_text("edited\n"),
    )


def http_subject(orders: ServiceBox) -> ConformanceSubject:
    adapter = HttpAdapter(orders.url)
    other = HttpAdapter(orders.url)

    def another_callers_order() -> None:
        action = order_call("someone-else", 9, 0)
        other.execute(
            action,
            action.intent_digest,
            Fence(run_id="another-run", lease_version=1, state_version=1),
            None,
        )

    return ConformanceSubject(
        adapter=adapter,
        make_write=order_call,
        effects=orders.effects,
        reopen=lambda: HttpAdapter(orders.url),
        drift=another_callers_order,
        checks_precondition=False,
    )


def router_subject(root: Path, clock: ManualClock, orders: ServiceBox) -> ConformanceSubject:
    files = workspace_subject(root, clock)
    router = RouterAdapter(files.adapter, HttpAdapter(orders.url))
    return ConformanceSubject(
        adapter=router,
        make_write=file_write,
        effects=files.effects,
        drift=files.drift,
        close=files.close,
        receipt_namespace="workspace",
    )


def git_subject(root: Path, url_of: Callable[[str], str], clock: ManualClock) -> ConformanceSubject:
    """A branch of a real git remote (``url_of(name)`` serves ``root/name``); each handle
    has its own object cache, as a worker on another host would."""
    bare, base = make_bare(root, {"app.py": b"x\n", "tests/test_app.py": b"pass\n"})
    branch = "ratchet/conformance-run"
    with Repo(str(bare)) as repo:
        repo.refs[b"refs/heads/" + branch.encode()] = base.encode()
    handles: list[GitWorkspaceAdapter] = []

    def open_handle() -> GitWorkspaceAdapter:
        remote = RemoteBranch(url_of(bare.name), branch, cache=root / f"cache-{len(handles)}")
        handles.append(
            GitWorkspaceAdapter(
                remote,
                base=base,
                run_id="conformance-run",
                allowed_paths=["app.py", "tests"],
                scratch=root / f"scratch-{len(handles)}",
                clock=clock,
            )
        )
        return handles[-1]

    ws = open_handle()

    def close() -> None:
        for handle in handles:
            handle.close()

    return ConformanceSubject(
        adapter=ws,
        make_write=file_write,
        effects=lambda: sum(writes_by_key(bare, branch).values()),
        reopen=open_handle,
        close=close,
        drift=lambda: push_foreign(bare, branch, {"app.py": b"edited\n"}) and None,
    )


def _run(check: ConformanceCheck, factory: Callable[[], ConformanceSubject]) -> None:
    if not run_check(check, factory):
        pytest.skip(f"the subject cannot {check.needs}")


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_the_memory_workspace_conforms(check: ConformanceCheck, clock: ManualClock) -> None:
    _run(check, lambda: memory_subject(clock))


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_the_workspace_adapter_conforms(
    check: ConformanceCheck, tmp_path: Path, clock: ManualClock
) -> None:
    _run(check, lambda: workspace_subject(tmp_path / "ws", clock))


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_the_http_adapter_on_the_reference_service_conforms(
    check: ConformanceCheck, orders: ServiceBox
) -> None:
    _run(check, lambda: http_subject(orders))


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_the_router_over_workspace_and_http_conforms(
    check: ConformanceCheck, tmp_path: Path, clock: ManualClock, orders: ServiceBox
) -> None:
    _run(check, lambda: router_subject(tmp_path / "ws", clock, orders))


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_the_git_workspace_over_file_urls_conforms(
    check: ConformanceCheck, tmp_path: Path, clock: ManualClock
) -> None:
    _run(check, lambda: git_subject(tmp_path, lambda name: f"file://{tmp_path}/{name}", clock))


@pytest.mark.skipif(NO_GIT is not None, reason=str(NO_GIT))
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_the_git_workspace_over_git_daemon_conforms(
    check: ConformanceCheck, tmp_path: Path, clock: ManualClock
) -> None:
    with GitDaemon(tmp_path) as daemon:
        _run(check, lambda: git_subject(tmp_path, daemon.url, clock))


@pytest.mark.skipif(NO_GIT is not None, reason=str(NO_GIT))
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_the_git_workspace_over_smart_http_conforms(
    check: ConformanceCheck, tmp_path: Path, clock: ManualClock
) -> None:
    with GitHttp(tmp_path) as http:
        _run(check, lambda: git_subject(tmp_path, http.url, clock))


def test_an_adapter_that_ignores_fences_fails_conformance_naming_the_check(
    clock: ManualClock,
) -> None:
    def careless() -> ConformanceSubject:
        subject = memory_subject(clock)
        ws = subject.adapter
        assert isinstance(ws, MemoryWorkspace)
        ws._check_fence = lambda fence: None  # type: ignore[method-assign]
        return subject

    verdicts = run_conformance(careless)
    assert verdicts["fence_lower_than_seen_is_refused"].startswith("failed")
    assert verdicts["same_key_same_intent_returns_the_identical_receipt"] == "passed"
    with pytest.raises(ConformanceError) as caught:
        run_check("stale_request_after_newer_request_is_refused", careless)
    assert caught.value.check == "stale_request_after_newer_request_is_refused"  # type: ignore[attr-defined]
