"""ratchet: a runtime for long agent tasks on a fleet of workers, with signed checkpoints,
fenced leases and exactly-once external effects. See README.md and DESIGN notes in docs/."""

__version__ = "0.2.0"

__all__ = ["__version__"]
