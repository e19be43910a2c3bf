"""The router answers a repeated combination of its parts' observations from the last
few it made, and only for parts that read the same: a part that moved on is combined
anew."""

from __future__ import annotations

from ratchet.adapters.router import RouterAdapter
from ratchet.testing.memory import ManualClock, MemoryWorkspace


def _router() -> tuple[RouterAdapter, MemoryWorkspace, MemoryWorkspace]:
    clock = ManualClock()
    files = MemoryWorkspace("ws-a", {"app.py": "print(1)\n"}, clock=clock)
    tools = MemoryWorkspace("tools-b", {}, clock=clock)
    return RouterAdapter(files, tools=tools), files, tools


def test_the_same_parts_give_the_same_combination_as_combine_itself() -> None:
    router, files, tools = _router()
    first = router.observe()
    assert router.observe() == first
    assert first == RouterAdapter.combine({"files": files.observe(), "tools": tools.observe()})


def test_a_part_whose_version_or_state_moved_is_combined_anew() -> None:
    router, files, tools = _router()
    before = router.observe()
    tools.version += 1
    moved = router.observe()
    assert moved.version == before.version + 1
    assert moved.fingerprint != before.fingerprint
    files.files["app.py"] = "print(2)\n"  # same version, other content
    edited = router.observe()
    assert edited.version == moved.version
    assert edited.fingerprint != moved.fingerprint
    tools.version -= 1
    files.files["app.py"] = "print(1)\n"
    assert router.observe() == before  # back to the first facts: the first answer


def test_many_distinct_states_keep_only_a_few_combinations() -> None:
    router, files, _ = _router()
    for n in range(50):
        files.version = n + 1
        assert router.observe().version == n + 2
    assert len(router._recent) <= 4
