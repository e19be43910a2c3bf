"""The multi-host drill's cancel: a run that ended before ``ratchet cancel`` reached it
("nothing to cancel") leaves the fault unexercised, so the next run still going is
cancelled instead (a few times at most); any other refusal ends the attempt."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ratchet.chaos.drill.hostloss import CancelThenSubmit
from ratchet.chaos.drill.hostplan import RunInfo


@dataclass
class Answered:
    """A finished command, as ``Command.result`` reports one."""

    exit: int
    stderr: str

    def result(self) -> dict[str, Any]:
        return {"what": "cancel", "exit": self.exit, "answer": None, "stderr": self.stderr}


@dataclass
class Drill:
    runs: dict[str, RunInfo]
    final: dict[str, tuple[str, str]]
    cancels: list[dict[str, Any]] = field(default_factory=list)

    @property
    def record(self) -> Any:
        return SimpleNamespace(runs=self.runs, final=self.final, cancels=self.cancels)

    @property
    def hosts(self) -> dict[str, Any]:
        return {"h1": SimpleNamespace(up=True)}


def drill() -> Drill:
    runs = {f"r{i}": RunInfo(run_id=f"r{i}", index=i, host="h1") for i in range(3)}
    return Drill(runs=runs, final={"r0": ("terminal", "completed")})


def asked(ctx: Drill, answer: Answered) -> CancelThenSubmit:
    log: dict[str, Any] = {"run_id": "r0", "on_host": "h1"}
    ctx.cancels.append(log)
    cancel = CancelThenSubmit(ctx.runs["r0"], "h1", log, command=answer)  # type: ignore[arg-type]
    cancel.step(ctx)  # type: ignore[arg-type]
    return cancel


def test_a_run_that_ended_first_is_replaced_by_the_next_one_still_going() -> None:
    ctx = drill()
    refused = Answered(2, "ratchet: error: the run is completed; nothing to cancel")
    cancel = asked(ctx, refused)
    assert not cancel.done and cancel.run.run_id == "r1" and cancel.command is None
    assert ctx.cancels[0]["run_id"] == "r1" and "command" not in ctx.cancels[0]
    assert ctx.cancels[0]["ended_first"][0]["run_id"] == "r0"


def test_any_other_refusal_ends_the_attempt() -> None:
    ctx = drill()
    cancel = asked(ctx, Answered(2, "ratchet: error: the store cannot be reached"))
    assert cancel.done and cancel.run.run_id == "r0"
    assert ctx.cancels[0]["command"]["exit"] == 2


def test_it_gives_up_after_three_runs_that_ended_first() -> None:
    ctx = drill()
    runs = {f"r{i}": RunInfo(run_id=f"r{i}", index=i, host="h1") for i in range(6)}
    ctx.runs.update(runs)
    refused = Answered(2, "the run is completed; nothing to cancel")
    cancel = asked(ctx, refused)
    for _ in range(3):
        cancel.command = refused  # type: ignore[assignment]
        cancel.step(ctx)  # type: ignore[arg-type]
    assert cancel.done and cancel.retargets == 3
