"""LangGraph's own conformance suite against the saver, on a real Redis and on fakeredis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from ratchet.langgraph import RatchetSaver
from ratchet.runtime.signing import KeyRing

from .conftest import Backend

conformance = pytest.importorskip("langgraph.checkpoint.conformance")
from langgraph.checkpoint.conformance.capabilities import ALL_CAPABILITIES  # noqa: E402


def _run(backend: Backend, keyring: KeyRing, *, async_client: bool) -> Any:
    async def factory() -> AsyncIterator[RatchetSaver]:
        aclient = backend.aclient() if async_client else None
        yield RatchetSaver(backend.client(), aclient=aclient, keyring=keyring, owner="conformance")
        if aclient is not None:
            await aclient.aclose()

    registered = conformance.checkpointer_test(name=f"RatchetSaver[{backend.name}]")(factory)
    return asyncio.run(conformance.validate(registered))


@pytest.mark.slow
@pytest.mark.parametrize("async_client", [True, False], ids=["asyncio-client", "sync-client"])
def test_every_capability_is_declared_and_passes(
    backend: Backend, keyring: KeyRing, async_client: bool
) -> None:
    report = _run(backend, keyring, async_client=async_client)
    results = report.results
    assert {name for name, r in results.items() if r.detected} == {
        c.value for c in ALL_CAPABILITIES
    }
    failures = {name: r.failures for name, r in results.items() if r.passed is not True}
    assert failures == {}
    assert report.conformance_level() == "FULL"
    passed = sum(r.tests_passed for r in results.values())
    assert passed == sum(r.tests_passed + r.tests_failed for r in results.values())
    assert passed >= 81
