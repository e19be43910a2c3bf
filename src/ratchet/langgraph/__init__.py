"""``ratchet[langgraph]``: a LangGraph checkpointer that refuses stale writers and unsigned
or rolled-back state.

:class:`RatchetSaver` implements LangGraph's ``BaseCheckpointSaver`` (sync and async) on
Redis. Every checkpoint, channel value and pending write is signed with the checkpoint key
ring; every write is fenced by a per-thread lease checked in the same Lua script that
writes; the store keeps each thread's head and generation high-water mark, so the latest
checkpoint is what the store says, never what a worker clock says. See
``docs/langgraph.md``.

Typical use by a worker::

    saver = RatchetSaver.from_url(url, keyring=keyring, owner="worker-7")
    graph = builder.compile(checkpointer=saver)
    lease = saver.claim(thread_id)                    # LeaseHeldElsewhereError if taken
    graph.invoke(inputs, lease.config(), durability="sync")

or, with LangGraph's write-ownership convention (a writer bound to one claim, whose lease
a background heartbeat renews; see :mod:`ratchet.langgraph.writer`)::

    with saver.claim_write_ownership(thread_id, heartbeat=True) as writer:
        builder.compile(checkpointer=writer).invoke(inputs, writer.config(), durability="sync")
"""

from __future__ import annotations

from ratchet.langgraph.keyspace import ThreadKeys, thread_keys, thread_tag
from ratchet.langgraph.replies import LEASE_KEY, LeaseInfo, Takeover, ThreadLease
from ratchet.langgraph.saver import DEFAULT_LEASE_TTL_MS, RatchetSaver, default_serde
from ratchet.langgraph.writer import ThreadWriter

__all__ = [
    "DEFAULT_LEASE_TTL_MS",
    "LEASE_KEY",
    "LeaseInfo",
    "RatchetSaver",
    "Takeover",
    "ThreadKeys",
    "ThreadLease",
    "ThreadWriter",
    "default_serde",
    "thread_keys",
    "thread_tag",
]
