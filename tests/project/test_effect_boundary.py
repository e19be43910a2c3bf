"""One place performs effects: outside the port implementations themselves, only the
executor (``ratchet/worker/executor.py``) calls an adapter or a generation store.

The check reads the source (an AST walk, like CI's ``assert`` check): a call of an
adapter port method on something named like an adapter, a call of a store port method on
something named like a store or a lease, and any call of the two methods no other object
has (``raise_fence``, ``commit_batch``) is a finding, wherever it appears.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "ratchet"

ADAPTER_METHODS = frozenset(
    {"observe", "project", "raise_fence", "execute", "lookup", "read", "verify"}
)
STORE_METHODS = frozenset({"high_water", "load", "commit_batch"})
DISTINCT = frozenset({"raise_fence", "commit_batch"})
ADAPTERISH = re.compile(r"(adapter|workspace|router)\b|\bparts?\b|\.files\b", re.IGNORECASE)
STOREISH = re.compile(r"(store|lease|creator)\b", re.IGNORECASE)

# Where effects are performed (the executor) or implemented (adapters composing adapters,
# the Redis store and its lease handle), and the test harness that exercises them.
ALLOWED = (
    "worker/executor.py",
    "adapters/",
    "tools/",  # the declared tools' environment: adapters over tools and their ledger
    "leasing/",
    "testing/",  # the doubles and the conformance kit, which calls adapters to test them
    "chaos/orders.py",  # the reference orders service: the server side of an adapter
    # The simulator's adapters (over its simulated world) and the store wrapper it hands
    # the real executor: the port side, as the doubles in testing/ are.
    "chaos/sim/world.py",
    "chaos/sim/worker.py",
)


def findings(source: str, name: str = "<src>") -> list[str]:
    """Every call in ``source`` that performs an engine effect outside the executor."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        method = node.func.attr
        receiver = ast.unparse(node.func.value)
        if receiver == "effects":
            continue  # ratchet.runtime.effects: builds an effect, performs nothing
        if (
            method in DISTINCT
            or (method in ADAPTER_METHODS and ADAPTERISH.search(receiver))
            or (method in STORE_METHODS and STOREISH.search(receiver))
        ):
            found.append((node.lineno, f"{name}:{node.lineno} {receiver}.{method}(...)"))
    return [text for _, text in sorted(found)]


def test_only_the_executor_calls_an_adapter_or_a_store() -> None:
    found: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        if relative.startswith(ALLOWED):
            continue
        found += findings(path.read_text(encoding="utf-8"), relative)
    assert found == []


def test_the_check_finds_the_calls_it_forbids() -> None:
    """The check itself can fail: each shape of a forbidden call is found."""
    source = """
def step(self, adapter, lease, executor, thing):
    self.adapter.observe()
    adapter.execute(action, intent, fence, None)
    executor.adapter.lookup("k")
    lease.commit_batch(key, batch)
    self.store.high_water(key)
    thing.raise_fence(fence)
    yield from effects.commit(key, batch)   # an effect yielded, not performed: allowed
    lease.read(with_checkpoint=True)   # a lease read, not a port call: allowed
    json.load(handle)                  # not a store: allowed
"""
    assert [f.split(" ", 1)[1] for f in findings(source)] == [
        "self.adapter.observe(...)",
        "adapter.execute(...)",
        "executor.adapter.lookup(...)",
        "lease.commit_batch(...)",
        "self.store.high_water(...)",
        "thing.raise_fence(...)",
    ]
