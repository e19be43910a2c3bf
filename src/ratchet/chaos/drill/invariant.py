"""One invariant's verdict: pass, fail or unknown, with what it saw."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Invariant"]


@dataclass(frozen=True, slots=True)
class Invariant:
    name: str
    status: str  # pass | fail | unknown
    detail: str
    injections: int  # faults behind this verdict

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "detail": self.detail, "injections": self.injections}
