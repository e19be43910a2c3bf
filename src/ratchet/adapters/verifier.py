"""The verifier: allow-listed commands run in the workspace, bound to what they ran against.

Each target name maps to one fixed command (for example ``pytest -q tests/``). A run:

1. observes the workspace (instance, version, fingerprint, git facts);
2. starts the command in its own process group, in the workspace, with a clean
   environment (a minimal ``PATH``, ``HOME`` and ``TMPDIR`` inside the state folder,
   ``PYTHONDONTWRITEBYTECODE=1``, nothing inherited: no tokens, no keys), confined by the
   :class:`~ratchet.adapters.sandbox.Sandbox` (bubblewrap by default: it runs code the
   agent wrote, and must not see the worker's keys, environment, processes or journal);
3. keeps at most ``max_output_bytes`` of combined output and kills the whole group at the
   timeout;
4. observes again. If anything changed while the command ran, the report is not bound to
   one state: it fails closed (``passed=False``) whatever the exit code.

The :class:`ratchet.runtime.ports.VerifierReport` names the environment observed in step
1; its ``output_digest`` covers the target, exit code, timeout flag, truncation flag and
the kept output, so a report cannot be paired with another run's output.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ratchet.adapters.sandbox import Sandbox, SandboxMode
from ratchet.errors import AdapterError, ConfigurationError
from ratchet.runtime.canonical import digest
from ratchet.runtime.ports import Observation, VerifierReport
from ratchet.runtime.types import check_rel_path

__all__ = ["CommandVerifier", "VerifiedWorkspace", "VerifierCommand", "VerifierRun"]

_OUTPUT_DOMAIN = b"ratchet/verifier-output/v1"
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


class VerifiedWorkspace(Protocol):
    """What a verifier needs from a workspace: where it is and how to observe it."""

    @property
    def root(self) -> Path: ...

    @property
    def state_dir(self) -> Path: ...

    def observe(self) -> Observation: ...


@dataclass(frozen=True, slots=True)
class VerifierCommand:
    """One allow-listed command.

    ``argv`` is run without a shell; ``cwd`` is a folder relative to the workspace root;
    ``env`` adds fixed, non-secret variables to the clean environment.
    """

    argv: tuple[str, ...]
    timeout_seconds: float = 300.0
    max_output_bytes: int = 64 * 1024
    cwd: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    network: bool = False  # inside the sandbox: no network unless the task allows it


@dataclass(frozen=True, slots=True)
class VerifierRun:
    """The last run of a target, for operators (the report itself carries digests only)."""

    target: str
    passed: bool
    bound: bool
    exit_code: int | None
    timed_out: bool
    truncated: bool
    output: str


class CommandVerifier:
    """Runs allow-listed commands by target name.

    Raises (constructor):
        ConfigurationError: an empty command, a bad ``cwd``, a non-positive timeout or
            output limit.
    """

    def __init__(
        self,
        commands: Mapping[str, VerifierCommand | Sequence[str]],
        *,
        path: str = DEFAULT_PATH,
        sandbox: Sandbox | None = None,
    ) -> None:
        self._commands: dict[str, VerifierCommand] = {}
        for target, spec in commands.items():
            command = (
                spec if isinstance(spec, VerifierCommand) else VerifierCommand(argv=tuple(spec))
            )
            if not command.argv:
                raise ConfigurationError("verifier command is empty", target=target)
            if command.timeout_seconds <= 0 or command.max_output_bytes <= 0:
                raise ConfigurationError(
                    "verifier timeout and output limit must be positive", target=target
                )
            if command.cwd is not None:
                try:
                    check_rel_path(command.cwd)
                except ValueError as exc:
                    raise ConfigurationError(f"verifier cwd: {exc}", target=target) from None
            self._commands[target] = command
        self._path = path
        self._sandbox = sandbox
        self.last_run: VerifierRun | None = None

    @property
    def sandbox(self) -> Sandbox:
        """The confinement commands run in (``auto``, resolved on first use, by default)."""
        if self._sandbox is None:
            self._sandbox = Sandbox.resolve(SandboxMode.AUTO)
        return self._sandbox

    def __repr__(self) -> str:
        return f"CommandVerifier(targets={sorted(self._commands)!r})"

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(sorted(self._commands))

    def _environment(
        self, workspace: VerifiedWorkspace, command: VerifierCommand
    ) -> dict[str, str]:
        home = workspace.state_dir / "verifier-home"
        tmp = workspace.state_dir / "verifier-tmp"
        home.mkdir(exist_ok=True)
        tmp.mkdir(exist_ok=True)
        env = {
            "PATH": self._path,
            "HOME": str(home),
            "TMPDIR": str(tmp),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "NO_COLOR": "1",
        }
        env.update(command.env)
        return env

    def run(self, workspace: VerifiedWorkspace, target: str) -> VerifierReport:
        """Run ``target`` against ``workspace`` and report, bound to the state it saw.

        Raises:
            AdapterError: unknown target (retryable=False); the command could not be
                started (retryable=True); observing failed.
        """
        command = self._commands.get(target)
        if command is None:
            raise AdapterError(
                "verifier target is not allow-listed", retryable=False, target=target
            )
        sandbox = self.sandbox
        sandbox.check_usable()
        before = workspace.observe()
        cwd = workspace.root / command.cwd if command.cwd else workspace.root
        env = self._environment(workspace, command)
        argv, env, extra = sandbox.command(
            command.argv,
            cwd=cwd,
            env=env,
            workspace=workspace.root,
            state_dir=workspace.state_dir,
            network=command.network,
            writable=(Path(env["HOME"]), Path(env["TMPDIR"])),
        )
        exit_code, timed_out, output, truncated = _run_bounded(
            command, argv=argv, cwd=cwd, env=env, extra=extra
        )
        after = workspace.observe()
        bound = before.same_state(after) and before.details == after.details
        passed = bound and exit_code == 0 and not timed_out
        text = output.decode("utf-8", "replace")
        self.last_run = VerifierRun(
            target=target,
            passed=passed,
            bound=bound,
            exit_code=exit_code,
            timed_out=timed_out,
            truncated=truncated,
            output=text,
        )
        output_digest = digest(
            _OUTPUT_DOMAIN,
            {
                "target": target,
                "exit_code": exit_code,
                "timed_out": timed_out,
                "truncated": truncated,
                "bound": bound,
                "output_sha256": hashlib.sha256(output).hexdigest(),
            },
        )
        return VerifierReport(
            target=target,
            passed=passed,
            env_instance_id=before.instance_id,
            env_version=before.version,
            env_fingerprint=before.fingerprint,
            output_digest=output_digest,
        )


def _run_bounded(
    command: VerifierCommand,
    *,
    argv: list[str],
    cwd: Path,
    env: dict[str, str],
    extra: dict[str, Any],
) -> tuple[int | None, bool, bytes, bool]:
    """Run ``argv`` (``command``'s, as the sandbox wraps it) under ``command``'s limits;
    return (exit code, timed out, kept output, truncated)."""
    try:
        proc = subprocess.Popen(  # noqa: S603 - an allow-listed argv, no shell
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **extra,
        )
    except OSError as exc:
        raise AdapterError(
            "verifier command could not be started", retryable=True, error=type(exc).__name__
        ) from None
    deadline = time.monotonic() + command.timeout_seconds
    kept = bytearray()
    truncated = timed_out = False
    stdout = proc.stdout
    if stdout is None:  # for the type checker: stdout=PIPE always gives a pipe
        raise AdapterError("verifier output pipe is missing", retryable=True)
    with selectors.DefaultSelector() as selector:
        selector.register(stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if not selector.select(timeout=remaining):
                continue
            chunk = os.read(stdout.fileno(), 1 << 16)
            if not chunk:
                break  # EOF: every writer closed the pipe
            room = command.max_output_bytes - len(kept)
            if len(chunk) > room:
                truncated = True
            kept += chunk[: max(room, 0)]
    exit_code: int | None = None
    if not timed_out:
        try:
            exit_code = proc.wait(timeout=max(deadline - time.monotonic(), 0.001))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out:
        # Kill the whole group (the command and anything it started) before reaping the
        # leader, so the group id cannot have been reused by then.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        exit_code = None
    stdout.close()
    return exit_code, timed_out, bytes(kept), truncated
