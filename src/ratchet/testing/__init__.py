"""Test support that ships with ratchet but is not part of it: the in-memory doubles of
the ports (:mod:`.memory`), the adapter conformance kit (:mod:`.conformance`) and a local
Redis Cluster (:mod:`.cluster`). No product package imports it (an import-linter
contract). A user's adapter test uses the conformance kit (``docs/adapters.md``)."""

__all__: list[str] = []
