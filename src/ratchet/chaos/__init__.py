"""The chaos harness: failpoints, the drill, its checker and the reference orders service.

``ratchet drill`` is a user-facing feature, so this package ships with ratchet, but no
product package imports it (an import-linter contract): a worker lets it in only through
its hooks (:mod:`ratchet.worker.hooks`; :mod:`ratchet.chaos.hooks` implements them), and
the command line wires the drill in. See ``docs/drills.md``.
"""

__all__: list[str] = []
