"""The environment of a run's declared tools: an :class:`Adapter` over a tool ledger.

Observation: the ledger's instance id and version, and a fingerprint over them and the
digest of the permitted tools' contracts (:attr:`ToolsAdapter.contract_digest`), so a run
restored with a tool whose contract changed (risk, recovery, arguments) fails closed like
any other drift. Every committed call moves the version on by one. The observation
carries no details: every field of it is copied into each checkpoint several times
(the environment, the pending write's before and after), and the contract is bound by
the fingerprint already.

A write, end to end (the engine committed the intent already)::

    ledger: fence check + key check + precondition (+ a fsync'd 'started' row for a
            tool whose recovery is review)
    [hook "before_call"] -> tool.run(args, call) -> [hook "after_call"]
    ledger: 'committed' line with the receipt, version + 1

Recovery of a key (``lookup_for``; the engine asks it after a crash, and ``execute``
applies the same rules when it finds a ``started`` row):

============================  ===========  ==============  =========================
ledger row for the key        ``lookup``   ``idempotent``  ``review``
============================  ===========  ==============  =========================
none                          tool.lookup  None: send      None: never sent, send
                              (found: its  again, same
                              receipt;     key
                              none: send)
``committed``                 its receipt  its receipt     its receipt
``aborted`` (no effect)       None: send   None: send      None: send
``started`` (outcome hidden)  (not kept)   (not kept)      OutcomeUnknownError
                                                           (needs_review, never
                                                           sent again)
============================  ===========  ==============  =========================

A write whose answer went past the byte cap (:mod:`ratchet.limits`), or whose lookup's
did, is an outcome unknown whatever the tool's recovery: ``OutcomeUnknownError`` (from the
:class:`~ratchet.errors.PeerAnswerTooLargeError`), so the run waits in ``needs_review``
and nothing sends the call again. A read past the cap is refused by that error.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ratchet.adapters.workspace import SystemClock
from ratchet.errors import (
    AdapterError,
    ConfigurationError,
    FenceRejectedError,
    IdempotencyConflictError,
    OutcomeUnknownError,
    PeerAnswerTooLargeError,
)
from ratchet.runtime.actions import Action
from ratchet.runtime.canonical import Domain, canonical_json, digest
from ratchet.runtime.catalog import Recovery, ToolCatalog
from ratchet.runtime.ports import (
    Clock,
    Fence,
    Observation,
    ReadResult,
    Receipt,
    VerifierReport,
)
from ratchet.tools.declare import Found, RecordedCall, Tool, ToolCall
from ratchet.tools.ledger import CallIntent, CallLedger, ToolLedger

__all__ = ["MAX_OUTPUT_CHARS", "ToolCheck", "ToolsAdapter", "output_result"]

log = logging.getLogger(__name__)

#: The longest output text a receipt keeps (the digest always covers the whole output).
MAX_OUTPUT_CHARS = 1 << 16


def _no_hook(stage: str) -> None:
    """Tests and drills inject crashes at ``before_call`` and ``after_call``."""


def _plain(output: Any) -> Any:
    return output.model_dump(mode="json") if isinstance(output, BaseModel) else output


def output_result(tool: str, output: Any) -> dict[str, str | int]:
    """A tool's output as a receipt's ``result``: the tool's name, the output as canonical
    JSON, whole; or cut at :data:`MAX_OUTPUT_CHARS`, with ``output_truncated`` 1 and the
    whole output's digest (``output_sha256``).

    Raises:
        AdapterError: the output is not JSON (floats, non-string keys, other objects);
            retryable=True: the call happened, so its outcome must be settled by recovery.
    """
    try:
        text = canonical_json(_plain(output)).decode()
    except Exception as exc:  # ContractError, TypeError: not JSON we can sign
        raise AdapterError(
            f"tool {tool} returned an output that is not canonical JSON ({type(exc).__name__})",
            retryable=True,
            tool=tool,
        ) from None
    result: dict[str, str | int] = {"tool": tool, "output": text[:MAX_OUTPUT_CHARS]}
    if len(text) > MAX_OUTPUT_CHARS:
        # The receipt keeps a prefix: the digest (over the whole output's canonical JSON,
        # under the tool-output domain) stands for the rest.
        result["output_truncated"] = 1
        result["output_sha256"] = hashlib.sha256(
            Domain.TOOL_OUTPUT + b"\x00" + text.encode()
        ).hexdigest()
    return result


def _cut_off(tool: str, key: str, refusal: PeerAnswerTooLargeError) -> OutcomeUnknownError:
    """A write whose answer went past the byte cap: its outcome is unknown (the refusal's
    peer, cap and bytes seen are carried for the review case and the incident)."""
    return OutcomeUnknownError(
        f"tool {tool}: {refusal.message}; the call may have happened and its answer cannot "
        "be kept: whether it happened is for a reviewer to find out",
        tool=tool,
        idempotency_key=key,
        peer=refusal.peer,
        limit_bytes=refusal.limit_bytes,
        seen_bytes=refusal.seen_bytes,
    )


@dataclass(frozen=True, slots=True)
class ToolCheck:
    """A verifier target answered by a read-only tool: called with ``arguments``, its
    output must hold ``expect`` (every key, recursively; lists and values whole) and
    contain every text of ``contains``."""

    tool: str
    arguments: Mapping[str, Any]
    expect: Mapping[str, Any]
    contains: tuple[str, ...] = ()

    def holds(self, output: Any) -> bool:
        """Whether ``output`` holds ``expect`` and every text of ``contains`` (in the
        output when it is text, else in its canonical JSON: a server that answers in
        prose is checked by what it says)."""
        if self.expect and not _holds(output, self.expect):
            return False
        text = output if isinstance(output, str) else canonical_json(output).decode()
        return all(part in text for part in self.contains)


def _holds(output: Any, expect: Any) -> bool:
    """Whether ``output`` holds ``expect``: an object holds every key of an expected
    object with a value that holds its expected value; anything else must be equal."""
    if isinstance(expect, Mapping):
        return isinstance(output, Mapping) and all(
            key in output and _holds(output[key], value) for key, value in expect.items()
        )
    return bool(output == expect)


class ToolsAdapter:
    """The declared tools a run may call, as one fenced, receipted environment.

    ``tools`` are the tools the run's scenario permits (others are not reachable);
    ``ledger`` is the environment's ledger file (created on first use; host-local), or a
    ledger object (the run's ledger in the store, :class:`~ratchet.tools.store_ledger.
    StoreLedger`, which any host reaches); ``clock`` stamps
    receipts (a worker passes the store's clock); ``hook`` is called at the crash points
    of a call (tests and drills).

    Raises (constructor):
        ConfigurationError: two tools with one name, or a bad declaration.
        AdapterError: the ledger cannot be opened (retryable=True).
    """

    enforces_preconditions = True

    def __init__(
        self,
        tools: Iterable[Tool],
        ledger: Path | str | CallLedger,
        *,
        clock: Clock | None = None,
        hook: Callable[[str], None] = _no_hook,
        namespace: str = "tools",
        checks: Mapping[str, ToolCheck] | None = None,
    ) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if t.spec.name in self._tools:
                raise ConfigurationError(f"two tools are named {t.spec.name!r}", field="tools")
            self._tools[t.spec.name] = t
        self.catalog = ToolCatalog(t.spec for t in self._tools.values())
        # What the fingerprint binds of each tool: its contract, or for a declared MCP
        # server's tool the operator's declaration of it (``bound_contract``), which submit
        # knows without starting the server (ratchet.fleet.mcp_servers).
        self._contract = digest(
            Domain.TOOL,
            {
                name: getattr(t, "bound_contract", None) or t.spec.contract
                for name, t in sorted(self._tools.items())
            },
        )
        if isinstance(ledger, Path | str):
            path = Path(ledger)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.ledger: CallLedger = ToolLedger(path)
        else:
            self.ledger = ledger
        self._clock: Clock = clock if clock is not None else SystemClock()
        # Observations by version: instance and contract are fixed for the adapter's life.
        self._observed: dict[int, Observation] = {}
        self._hook = hook
        self._namespace = namespace
        self._checks = dict(checks or {})
        for target, check in self._checks.items():
            found = self._tools.get(check.tool)
            if found is None or found.spec.is_write:
                raise ConfigurationError(
                    f"verifier target {target!r} is checked by tool {check.tool!r}, which is "
                    "not a read-only tool the scenario permits",
                    field=f"environment.checks.{target}",
                )

    def __repr__(self) -> str:
        return f"ToolsAdapter(tools={sorted(self._tools)}, ledger={str(self.ledger.path)!r})"

    def close(self) -> None:
        for t in self._tools.values():
            t.close()
        self.ledger.close()

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def contract_digest(self) -> str:
        """The digest of the permitted tools' contracts the observation's fingerprint
        binds (a changed contract is a changed environment)."""
        return self._contract

    @property
    def effects(self) -> int:
        """Calls committed in this environment."""
        return self.ledger.counters()[0]

    def tool(self, name: str) -> Tool:
        """The tool named ``name``.

        Raises:
            AdapterError: no such tool here (retryable=False).
        """
        found = self._tools.get(name)
        if found is None:
            raise AdapterError(f"this environment has no tool {name!r}", retryable=False, tool=name)
        return found

    # -- observation ------------------------------------------------------------------

    def _observation(self, version: int) -> Observation:
        cached = self._observed.get(version)
        if cached is not None:
            return cached
        made = self._observe_at(version)
        if len(self._observed) > 64:
            self._observed.clear()
        self._observed[version] = made
        return made

    def _observe_at(self, version: int) -> Observation:
        instance = self.ledger.instance_id
        return Observation(
            instance_id=instance,
            version=version,
            fingerprint=digest(
                Domain.ENVIRONMENT,
                {"instance_id": instance, "version": version, "contract": self._contract},
            ),
        )

    def observe(self) -> Observation:
        return self._observation(self.ledger.version)

    def project(self, action: Action, before: Observation) -> Observation | None:
        """One committed call moves the version on by one and changes nothing else."""
        current = self.observe()
        if not current.same_state(before) or action.expected_env_version != current.version:
            return None
        return self._observation(current.version + 1)

    # -- fences -----------------------------------------------------------------------

    def raise_fence(self, fence: Fence) -> None:
        """Raise ``fence`` at the ledger, then at every tool that checks fences itself.

        Raises:
            FenceRejectedError: the ledger or a tool has seen a newer fence.
        """
        self.ledger.raise_fence(fence)
        for t in self._tools.values():
            if t.checks_fences:
                t.raise_fence(fence)

    # -- writes -----------------------------------------------------------------------

    def _call(
        self, t: Tool, action: Action, fence: Fence, intent: str | None, approval: str | None
    ) -> Any:
        call = ToolCall(
            run_id=fence.run_id,
            tool=t.spec.name,
            idempotency_key=action.idempotency_key,
            fence=fence,
            intent_digest=intent,
            approval_digest=approval,
        )
        return t.run(t.parse_args(dict(action.args)), call)

    def execute(
        self, action: Action, intent_digest: str, fence: Fence, approval_digest: str | None
    ) -> Receipt:
        """Call the tool once under the action's key, or return the key's receipt.

        Raises:
            FenceRejectedError: the ledger (or the tool) has seen a newer fence.
            IdempotencyConflictError: the key belongs to another intent.
            OutcomeUnknownError: an earlier call of the key was cut off and the tool can
                neither look it up nor be called again (its recovery is ``review``), or
                this call's answer went past the byte cap (raised from the
                :class:`~ratchet.errors.PeerAnswerTooLargeError`).
            AdapterError: a refusal with no effect (retryable=False), or a failure whose
                outcome recovery settles (retryable=True).
        """
        t = self.tool(str(action.kind))
        spec = t.spec
        key = action.idempotency_key or ""
        # Only a review tool's started row is the sole proof of "never sent"; the others
        # are recovered by the tool itself, so their call is recorded once it returned.
        durable = spec.recovery is Recovery.REVIEW
        begin = functools.partial(
            self.ledger.begin_call,
            key=key,
            tool=spec.name,
            intent_digest=intent_digest,
            approval_digest=approval_digest,
            fence=fence,
            expected_version=action.expected_env_version,
            durable=durable,
        )
        try:
            # One round trip in the common case: the ledger checks the lease, the fence,
            # the key and the precondition, and says so when an earlier call of the key
            # is unresolved (its started row: a cut-off call), which is settled first.
            existing = begin(again=False)
        except AdapterError as exc:
            if exc.reason != "unresolved":
                raise
            settled = self._settle(t, key, intent_digest, action.args)
            if settled is not None:
                return settled
            existing = begin(again=True, fresh=True)  # _settle just read the ledger
        if existing is not None:
            return existing
        self._hook("before_call")
        intent = CallIntent(spec.name, intent_digest, approval_digest, fence)
        recorded = None if durable else intent  # the row to write on a refusal
        try:
            output = self._call(t, action, fence, intent_digest, approval_digest)
        except (FenceRejectedError, IdempotencyConflictError):
            self.ledger.abort_call(key, recorded)  # the tool refused it: no effect
            raise
        except PeerAnswerTooLargeError as exc:
            # Timeline: call sent -> the service answered past the byte cap -> reading
            # stopped. The write may have happened and its answer cannot be kept: nothing
            # may send it again (a second answer would be cut the same way) and no receipt
            # can be made. A review tool's started row stays; a reviewer decides.
            raise _cut_off(spec.name, key, exc) from exc
        except AdapterError as exc:
            if not exc.retryable:
                self.ledger.abort_call(key, recorded)
            raise
        except Exception as exc:
            # The call may or may not have reached the service: leave it to recovery.
            # Only the type is reported (a message may carry a secret).
            log.warning("tool %s failed: %s", spec.name, type(exc).__name__)
            raise AdapterError(
                f"tool {spec.name} failed ({type(exc).__name__}); its outcome is settled "
                "by recovery",
                retryable=True,
                tool=spec.name,
            ) from None
        self._hook("after_call")
        return self.ledger.commit_call(
            key,
            namespace=self._namespace,
            result=output_result(spec.name, output),
            committed_at=self._clock.now(),
            call=recorded,
        )

    def _settle(
        self, t: Tool, key: str, intent_digest: str, arguments: Mapping[str, Any] | None
    ) -> Receipt | None:
        """A call of ``key`` whose outcome is not recorded (a ``started`` row, or no row
        for a tool that records calls only once they returned): the receipt the tool's
        recovery finds, or None (the tool may be called with the same key). A lookup is
        told the recorded call (``arguments``: as proposed; None when only the ledger row
        is known) when it takes it.

        Raises:
            OutcomeUnknownError: a ``review`` tool's cut-off call, or a lookup whose answer
                went past the byte cap.
        """
        recovery = t.spec.recovery
        if recovery is Recovery.LOOKUP:
            try:
                found = t.recover(key, RecordedCall(t.spec.name, arguments, intent_digest))
            except PeerAnswerTooLargeError as exc:
                # The tool's record of the call is past the cap: it cannot be read, so the
                # call's outcome cannot be learnt from it.
                raise _cut_off(t.spec.name, key, exc) from exc
            if found is None:
                self.ledger.abort_call(key)
                return None
            # The key is bound to this intent (the checkpoint committed the pair before
            # the tool was called), unless the tool says which intent it found: then
            # the receipt names that one, and another intent opens a review.
            if isinstance(found, Found):
                intent_digest = found.intent_digest or intent_digest
                found = found.output
            return self.ledger.commit_call(
                key,
                namespace=self._namespace,
                result=output_result(t.spec.name, found),
                committed_at=self._clock.now(),
                call=CallIntent(t.spec.name, intent_digest, None, None)
                if self.ledger.row(key) is None
                else None,
            )
        if recovery is Recovery.IDEMPOTENT:
            return None
        raise OutcomeUnknownError(
            f"a call of tool {t.spec.name} was cut off and the tool can neither look its "
            "key up nor be called again: whether it happened is for a reviewer to find out",
            tool=t.spec.name,
            idempotency_key=key,
        )

    def lookup_for(self, action: Action) -> Receipt | None:
        """The receipt of ``action``'s key, settled by the tool's recovery (the module's
        table).

        Raises:
            OutcomeUnknownError: a cut-off call of a ``review`` tool.
            AdapterError: the tool's lookup failed.
        """
        row = self.ledger.row(action.idempotency_key or "")
        if row is not None and row.status == "committed":
            return row.receipt
        if row is not None and row.status == "aborted":
            return None
        t = self._tools.get(row.tool) if row is not None else None
        t = t or self.tool(str(action.kind))
        if row is None and t.spec.recovery is Recovery.REVIEW:
            return None  # its started row is written before any call: never sent
        return self._settle(t, action.idempotency_key or "", action.intent_digest, action.args)

    def lookup(self, idempotency_key: str) -> Receipt | None:
        """The ledger's receipt for the key (what an adapter's lookup promises), settled by
        the tool's recovery when the key's call is cut off (see :meth:`lookup_for`)."""
        row = self.ledger.row(idempotency_key)
        if row is None or row.status != "started":
            return row.receipt if row is not None else None
        return self._settle(self.tool(row.tool), idempotency_key, row.intent_digest, None)

    # -- reads ------------------------------------------------------------------------

    def read(self, action: Action) -> ReadResult:
        """Call a read-only tool; its output (canonical JSON) is the read's content.

        Raises:
            AdapterError: the tool failed, or it is not read-only (retryable=False).
        """
        t = self.tool(str(action.kind))
        if t.spec.is_write:
            raise AdapterError(
                f"tool {t.spec.name} writes; it is not read", retryable=False, tool=t.spec.name
            )
        version = self.ledger.version
        call = ToolCall(run_id="", tool=t.spec.name, idempotency_key=None, fence=None)
        try:
            output = t.run(t.parse_args(dict(action.args)), call)
        except AdapterError:
            raise
        except Exception as exc:
            raise AdapterError(
                f"tool {t.spec.name} failed ({type(exc).__name__})",
                retryable=True,
                tool=t.spec.name,
            ) from None
        text = canonical_json(_plain(output)).decode()
        return ReadResult(content=text[: 1 << 20], env_version=version)

    def verify(self, target: str) -> VerifierReport:
        """Answer verifier target ``target`` by its check (:class:`ToolCheck`): the read
        tool's output must hold the check's ``expect``, and the environment must be the
        same before and after (the report is bound to that state).

        Raises:
            AdapterError: no check for the target (retryable=False); the tool failed.
        """
        check = self._checks.get(target)
        if check is None:
            raise AdapterError(
                "no check answers this verifier target", retryable=False, target=target
            )
        before = self.observe()
        t = self.tool(check.tool)
        call = ToolCall(run_id="", tool=t.spec.name, idempotency_key=None, fence=None)
        try:
            output = _plain(t.run(t.parse_args(dict(check.arguments)), call))
        except AdapterError:
            raise
        except Exception as exc:
            raise AdapterError(
                f"tool {t.spec.name} failed ({type(exc).__name__})",
                retryable=True,
                tool=t.spec.name,
            ) from None
        after = self.observe()
        holds = check.holds(output)
        bound = before.same_state(after)
        return VerifierReport(
            target=target,
            passed=holds and bound,
            env_instance_id=before.instance_id,
            env_version=before.version,
            env_fingerprint=before.fingerprint,
            output_digest=digest(
                Domain.ENVIRONMENT,
                {
                    "check": target,
                    "tool": t.spec.name,
                    "holds": holds,
                    "bound": bound,
                    "output_sha256": hashlib.sha256(canonical_json(output)).hexdigest(),
                },
            ),
        )
