"""Chaos drills: real workers, a real Redis, real adapters, faults from a seeded schedule,
and a checker that reads the adapters' own records. See ``docs/drills.md``."""
