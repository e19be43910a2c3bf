"""Adapters: where side effects happen, with authoritative receipts and fence checks.

The contract every adapter keeps is the :class:`ratchet.runtime.ports.Adapter` protocol.
Real adapters (workspace files, verifier commands, git, HTTP APIs) arrive here; the
in-memory workspace used by the core's tests lives in :mod:`ratchet.runtime.memory`.
"""

__all__: list[str] = []
