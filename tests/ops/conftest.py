"""Fixtures for the operations tests: the worker suite's real Redis, settings and fleet."""

from __future__ import annotations

from tests.worker.conftest import fleet, redis_server, settings, workspace

__all__ = ["fleet", "redis_server", "settings", "workspace"]
