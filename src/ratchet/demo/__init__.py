"""The demos: ``ratchet demo`` (a fleet of real worker processes on the embedded Redis,
:mod:`.fleet`), ``ratchet demo --local`` (one process on in-memory stand-ins,
:mod:`.local`) and the example task both run (:mod:`.examples`). No product package
imports it (an import-linter contract)."""

__all__: list[str] = []
