"""The history tables answer exactly what a full scan answers, along any mix of appends,
branches and evictions."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratchet.runtime import history
from ratchet.runtime.history import extends, grow, key_positions, position


@dataclass(frozen=True, eq=False)
class Entry:
    idempotency_key: str


def _scan(executed: tuple[Entry, ...], key: str) -> int | None:
    for offset, entry in enumerate(executed):
        if entry.idempotency_key == key:
            return offset
    return None


# Each operation: (which earlier tuple to start from, what to do, a key).
OPS = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=40),
        st.sampled_from(["grow", "grow", "grow", "copy", "index"]),
        st.sampled_from(list("abcdefgh")),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, kept=st.sampled_from([2, 64]))
def test_positions_and_extends_match_a_full_scan(
    ops: list[tuple[int, str, str]], kept: int
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(history, "_GROWN_KEPT", kept)  # 2: evictions all the time
        patch.setattr(history, "_INDEXES_KEPT", kept)
        _check(ops)


def _check(ops: list[tuple[int, str, str]]) -> None:
    made: list[tuple[Entry, ...]] = [()]
    for pick, op, key in ops:
        base = made[pick % len(made)]
        if op == "grow":
            made.append(grow(base, Entry(key)))
        elif op == "copy":  # equal entries, but a tuple grow() never saw: a branch
            made.append((*[Entry(e.idempotency_key) for e in base], Entry(key)))
        else:
            key_positions(base)
        for executed in made:
            for probe in "abcdefghz":
                assert position(executed, probe) == _scan(executed, probe)
    for child in made[-8:]:
        for parent in made[-8:]:
            expected = len(parent) <= len(child) and child[: len(parent)] == parent
            assert extends(child, parent) is expected
