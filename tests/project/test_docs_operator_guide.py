"""The operator's guide names every incident kind the worker records, and only those, and
every reason a checkpoint restore can refuse with: the guide and the code cannot drift
apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ratchet.ops.diagnosis import FREEZING_KINDS
from ratchet.worker.jobprotocol import JobOutcome

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "operator-guide.md"
# Where incidents are recorded: the worker's job, operator operations, the fleet's parts.
WORKER = tuple(ROOT / "src" / "ratchet" / name for name in ("worker", "ops", "fleet"))
RUNTIME = ROOT / "src" / "ratchet" / "runtime"
#: Kinds the scan must find, so a scan that finds nothing cannot pass.
KNOWN = {
    "restore_refused",
    "environment_changed",
    "evidence_refused",
    "control_refused",
    "job_error",
    "store_record_unreadable",
    "operator_retry",
    "lease_taken_over",
    "verifier_failed",
    "reaper_entry_refused",
}


def _text(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _refused_kind(node: ast.Call) -> str | None:
    """The kind of a job protocol refusal, ``refuse(host, report, exc, JobOutcome.X)``
    (recorded as ``{"kind": kind.value, ...}``)."""
    name = node.func.id if isinstance(node.func, ast.Name) else None
    if name != "refuse" or len(node.args) != 4:
        return None
    kind = node.args[3]
    if (
        isinstance(kind, ast.Attribute)
        and isinstance(kind.value, ast.Name)
        and kind.value.id == "JobOutcome"
    ):
        return JobOutcome[kind.attr].value
    return None


def recorded_kinds() -> set[str]:
    """Every incident kind written in ``src/ratchet/{worker,ops,fleet}/*.py``: a ``{"kind": "..."}``
    record, a ``kind="..."`` argument or default, a ``("...", reason)`` pair that is
    recorded as ``{"kind": kind, ...}``, a job protocol refusal with its ``JobOutcome``."""
    kinds: set[str] = set()
    for path in sorted(p for folder in WORKER for p in folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and (refused := _refused_kind(node)) is not None:
                kinds.add(refused)
            elif isinstance(node, ast.Dict):
                kinds |= {
                    v
                    for k, v in (
                        (_text(k), _text(v)) for k, v in zip(node.keys, node.values, strict=True)
                    )
                    if k == "kind" and v is not None
                }
            elif isinstance(node, ast.keyword) and node.arg == "kind":
                kinds |= {v for v in [_text(node.value)] if v is not None}
            elif isinstance(node, ast.arguments):
                positional = [*node.posonlyargs, *node.args]
                pairs = [
                    *zip(
                        positional[len(positional) - len(node.defaults) :],
                        node.defaults,
                        strict=True,
                    ),
                    *zip(node.kwonlyargs, node.kw_defaults, strict=True),
                ]
                kinds |= {
                    v
                    for arg, default in pairs
                    if arg.arg == "kind" and (v := _text(default)) is not None
                }
            elif (
                isinstance(node, ast.Tuple)
                and len(node.elts) == 2
                and isinstance(node.elts[1], ast.Name)
                and node.elts[1].id == "reason"
            ):
                kinds |= {v for v in [_text(node.elts[0])] if v is not None}
    return kinds


def documented_kinds() -> set[str]:
    """The kinds the guide gives a section of their own (``### `kind` ``)."""
    return set(re.findall(r"^### `([a-z_]+)`", GUIDE.read_text(), flags=re.MULTILINE))


def restore_reasons() -> set[str]:
    """Every ``reason`` a checkpoint restore can refuse with (runtime checkpoint, restore
    and signing: ``_fail("reason", ...)``, ``_bad("reason", ...)``, ``reason="..."``)."""
    reasons: set[str] = set()
    for name in ("checkpoint.py", "restore.py", "signing.py"):
        source = (RUNTIME / name).read_text()
        reasons |= set(re.findall(r'_(?:fail|bad)\(\s*"([a-z_]+)"', source))
        reasons |= set(re.findall(r'reason="([a-z_]+)"', source))
    return reasons


def test_the_scan_finds_the_kinds_the_worker_is_known_to_record() -> None:
    assert recorded_kinds() >= KNOWN


def test_every_recorded_incident_kind_has_a_section_in_the_operator_guide() -> None:
    missing = recorded_kinds() - documented_kinds()
    assert not missing, f"docs/operator-guide.md has no section for {sorted(missing)}"


def test_the_operator_guide_documents_no_kind_the_worker_does_not_record() -> None:
    stale = documented_kinds() - recorded_kinds()
    assert not stale, f"docs/operator-guide.md documents kinds nothing records: {sorted(stale)}"


def test_every_kind_that_freezes_a_run_is_documented() -> None:
    assert documented_kinds() >= FREEZING_KINDS


def test_every_restore_refusal_reason_is_named_in_the_operator_guide() -> None:
    reasons = restore_reasons()
    assert {"bad_mac", "environment", "stale_generation", "trust"} <= reasons
    text = GUIDE.read_text()
    missing = sorted(r for r in reasons if f"`{r}`" not in text)
    assert not missing, f"docs/operator-guide.md does not name the reasons {missing}"
