"""A shell-command tool: an allow-listed program run in the verifier's sandbox.

What a call may do (``argv``, optionally ``stdin`` text) is bounded by the tool's
construction, never by the call: ``argv[0]`` must be one of the allowed programs (refused
before anything runs otherwise), and the program runs confined by bubblewrap
(:class:`ratchet.adapters.sandbox.Sandbox`, the confinement verifier commands get):

* the workspace root read-only (the adapter's state folder inside it, when there is one,
  replaced by an empty one), at its own path, named by ``$WORKSPACE``;
* a private scratch directory, fresh for each call and removed after it, as the working
  directory and ``$HOME``; a fresh ``/tmp``;
* host directories the tool was constructed with (``writable=``) read-write, for
  outputs the caller keeps; they may not lie inside the workspace;
* no network unless the tool was constructed with ``network=True``; a clean environment
  (no variable of the worker's), the worker's key files masked;
* a timeout, after which the whole process group is killed.

A command is a write that is never assumed idempotent and has no lookup: its recovery is
``review``. A call cut off after the command started (the worker died before the ledger
recorded the result) is never run again on its own: the run waits in ``needs_review``.
The ledger checks fences before the command runs; the command itself cannot.

Its output (the receipt's ``output``) records what happened, not what it printed::

    {"program": "/usr/bin/sh", "exit_status": 0, "timed_out": false,
     "stdout_sha256": "...", "stdout_bytes": 3, "stderr_sha256": "...", "stderr_bytes": 0}

The digests are plain SHA-256 over every byte of each stream (compare them with a copy
you hold). Output tails are kept only when the tool is given a ``scrub`` function (for a
worker, the fleet's :class:`ratchet.fleet.scrub.Scrubber` ``.scrub``, which this layer
may not import): a command run by an agent may print anything it could read, and a
receipt is kept and shown to operators. Without one, the receipt holds digests only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from ratchet.adapters.files import STATE_DIR
from ratchet.adapters.sandbox import Sandbox, SandboxMode
from ratchet.adapters.verifier import DEFAULT_PATH
from ratchet.errors import AdapterError, ConfigurationError
from ratchet.runtime.actions import Risk
from ratchet.tools.declare import Tool, ToolCall

__all__ = ["MAX_ARGV", "MAX_ARG_CHARS", "MAX_STDIN_CHARS", "ShellArgs", "ShellTool"]

#: Bounds of one call's arguments.
MAX_ARGV = 64
MAX_ARG_CHARS = 4096
MAX_STDIN_CHARS = 1 << 20

_Arg = Annotated[str, Field(max_length=MAX_ARG_CHARS, pattern=r"^[^\x00]*$")]


class ShellArgs(BaseModel):
    """One command: ``argv`` (``argv[0]`` an allowed program) and optional ``stdin``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    argv: list[_Arg] = Field(
        min_length=1,
        max_length=MAX_ARGV,
        description="the program (one the tool allows) and its arguments; no shell",
    )
    stdin: str | None = Field(
        default=None, max_length=MAX_STDIN_CHARS, description="text fed to the program"
    )


@dataclass
class _Stream:
    """One output stream: every byte digested and counted, the last ``keep`` kept."""

    keep: int
    sha: Any = field(default_factory=hashlib.sha256)
    size: int = 0
    tail: bytearray = field(default_factory=bytearray)

    def feed(self, chunk: bytes) -> None:
        self.sha.update(chunk)
        self.size += len(chunk)
        if self.keep:
            self.tail += chunk
            if len(self.tail) > self.keep:
                del self.tail[: len(self.tail) - self.keep]


@dataclass(frozen=True, slots=True)
class _Finished:
    exit_status: int | None
    timed_out: bool
    stdout: _Stream
    stderr: _Stream


class ShellTool(Tool):
    """Run an allow-listed program in the sandbox (see the module docstring).

    ``workspace`` is mounted read-only; ``programs`` are the allowed ``argv[0]`` values
    (a bare name is found on ``path``; matched exactly as written, so allow ``sh`` or
    ``/bin/sh``, and know that allowing a shell allows whatever it can run in there);
    ``writable`` host directories are bound read-write; ``timeout_seconds`` bounds a call;
    ``tail_bytes`` is how much of each stream a receipt keeps, only with ``scrub``;
    ``env`` adds fixed, non-secret variables; ``scratch_root`` is where the per-call
    scratch directories are made (the system's temp directory by default).

    Raises (constructor):
        ConfigurationError: no workspace, an empty or unknown program list, a writable
            folder or ``scratch_root`` that is missing or overlaps the workspace, a
            non-positive timeout, a sandbox that is not bubblewrap, or a bad declaration
            (name, risk).
    """

    name: ClassVar[str] = "shell"
    risk: ClassVar[Risk | str] = Risk.IRREVERSIBLE_EXTERNAL_WRITE
    Args: ClassVar[type[BaseModel]] = ShellArgs
    description: ClassVar[str] = (
        "Run an allowed program with arguments in a sandbox: the workspace is read-only, "
        "a private scratch directory is the working directory and HOME."
    )

    def __init__(
        self,
        workspace: str | os.PathLike[str],
        programs: Iterable[str],
        *,
        name: str | None = None,
        risk: Risk | str | None = None,
        description: str | None = None,
        requires_approval: bool | None = None,
        network: bool = False,
        timeout_seconds: int = 60,
        writable: Iterable[str | os.PathLike[str]] = (),
        env: Mapping[str, str] | None = None,
        path: str = DEFAULT_PATH,
        sandbox: Sandbox | None = None,
        scratch_root: str | os.PathLike[str] | None = None,
        scrub: Callable[[str], str] | None = None,
        tail_bytes: int = 2048,
    ) -> None:
        self.declare(
            name=name, risk=risk, description=description, requires_approval=requires_approval
        )
        root = Path(workspace).resolve()
        if not root.is_dir():
            raise ConfigurationError(
                "the shell tool's workspace is not a folder", field="workspace"
            )
        self.workspace = root
        self._programs = _resolve_programs(programs, path)
        self._writable = tuple(_check_writable(p, root) for p in writable)
        if timeout_seconds <= 0 or tail_bytes < 0:
            raise ConfigurationError(
                "the shell tool's timeout must be positive and its tail not negative",
                field="timeout_seconds",
            )
        if sandbox is not None and sandbox.mode is not SandboxMode.BWRAP:
            raise ConfigurationError(
                f"the shell tool runs only in a bubblewrap sandbox, not {sandbox.mode.value} "
                "(its read-only workspace is a bubblewrap mount)",
                field="sandbox",
            )
        self.network = network
        self.timeout_seconds = timeout_seconds
        self._env = dict(env or {})
        self._path = path
        self._sandbox = sandbox
        self._scratch_root = (
            _check_writable(scratch_root, root, what="scratch_root")
            if scratch_root is not None
            else None
        )
        self._scrub = scrub
        self._tail_bytes = tail_bytes if scrub is not None else 0
        self.spec  # noqa: B018 - declaration errors surface here, not at the first call

    def __repr__(self) -> str:
        return (
            f"ShellTool(name={self.name!r}, programs={sorted(self._programs)!r}, "
            f"network={self.network})"
        )

    @property
    def programs(self) -> tuple[str, ...]:
        """The allowed ``argv[0]`` values."""
        return tuple(sorted(self._programs))

    def _confinement(self) -> Sandbox:
        """The bubblewrap sandbox (resolved on first use when none was given).

        Raises:
            AdapterError: bubblewrap cannot run here (retryable=False: nothing ran).
        """
        if self._sandbox is None:
            try:
                self._sandbox = Sandbox.resolve(SandboxMode.BWRAP)
            except ConfigurationError as exc:
                raise AdapterError(
                    f"tool {self.name}: no sandbox to run commands in ({exc.message})",
                    retryable=False,
                    tool=self.name,
                ) from None
        return self._sandbox

    def run(self, args: Any, call: ToolCall) -> dict[str, Any]:
        """Run the command once; return what happened (the module docstring's output).

        A command that ran returns its output whatever its exit status or a timeout.

        Raises:
            AdapterError: retryable=False, nothing ran: ``argv[0]`` is not allowed, there
                is no sandbox, or the program could not be started. Anything raised once
                it started leaves the outcome unknown (recovery: review).
        """
        parsed: ShellArgs = args if isinstance(args, ShellArgs) else ShellArgs.model_validate(args)
        program = self._programs.get(parsed.argv[0])
        if program is None:
            raise AdapterError(
                f"tool {self.name}: program {parsed.argv[0][:64]!r} is not allowed",
                retryable=False,
                tool=self.name,
                allowed=self.programs,
            )
        try:
            stdin = None if parsed.stdin is None else parsed.stdin.encode("utf-8")
        except UnicodeEncodeError:
            raise AdapterError(
                f"tool {self.name}: stdin is not encodable text", retryable=False, tool=self.name
            ) from None
        sandbox = self._confinement()
        scratch = Path(tempfile.mkdtemp(prefix="ratchet-shell-", dir=self._scratch_root))
        try:
            finished = self._run_in(sandbox, scratch, [program, *parsed.argv[1:]], stdin)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return self._output(program, finished)

    def _run_in(
        self, sandbox: Sandbox, scratch: Path, argv: list[str], stdin: bytes | None
    ) -> _Finished:
        env = {
            "PATH": self._path,
            "HOME": str(scratch),
            "TMPDIR": "/tmp",  # noqa: S108 - a fresh tmpfs inside the sandbox
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "WORKSPACE": str(self.workspace),
            **self._env,
        }
        # The sandbox's "workspace" is the scratch directory here, bound read-write. The
        # real workspace is one more read-only path (bound before the scratch one), and
        # the folder Sandbox.command empties is the workspace adapter's state folder when
        # it has one (the journal stays out of reach).
        confined = dataclasses.replace(sandbox, read_only=(*sandbox.read_only, self.workspace))
        state = self.workspace / STATE_DIR
        command, popen_env, extra = confined.command(
            argv,
            cwd=scratch,
            env=env,
            workspace=scratch,
            state_dir=state if state.is_dir() else scratch / STATE_DIR,
            writable=self._writable,
            network=self.network,
            workspace_writable=True,
        )
        return _run_bounded(
            command,
            env=popen_env,
            cwd=scratch,
            extra=extra,
            stdin=stdin,
            timeout=float(self.timeout_seconds),
            keep=self._tail_bytes,
            tool=self.name,
        )

    def _output(self, program: str, finished: _Finished) -> dict[str, Any]:
        output: dict[str, Any] = {
            "program": program,
            "exit_status": finished.exit_status,
            "timed_out": finished.timed_out,
            "network": self.network,
            "stdout_sha256": finished.stdout.sha.hexdigest(),
            "stdout_bytes": finished.stdout.size,
            "stderr_sha256": finished.stderr.sha.hexdigest(),
            "stderr_bytes": finished.stderr.size,
        }
        if self._scrub is not None:
            for label, stream in (("stdout", finished.stdout), ("stderr", finished.stderr)):
                text = bytes(stream.tail).decode("utf-8", "ignore")
                output[f"{label}_tail"] = self._scrub(text)
                output[f"{label}_tail_cut"] = stream.size > len(stream.tail)
        return output


def _resolve_programs(programs: Iterable[str], path: str) -> dict[str, str]:
    """``argv[0]`` as allowed -> the absolute path it runs.

    Raises:
        ConfigurationError: none given, or one that is not an executable file.
    """
    found: dict[str, str] = {}
    for program in programs:
        resolved = program if "/" in program else shutil.which(program, path=path)
        if (
            resolved is None
            or not os.path.isabs(resolved)
            or not os.path.isfile(resolved)
            or not os.access(resolved, os.X_OK)
        ):
            raise ConfigurationError(
                f"allowed program {program!r} is not an executable file (absolute, or on {path})",
                field="programs",
            )
        found[program] = resolved
    if not found:
        raise ConfigurationError("the shell tool allows no program", field="programs")
    return found


def _check_writable(
    raw: str | os.PathLike[str], workspace: Path, *, what: str = "writable"
) -> Path:
    """A folder bound read-write: it exists and neither holds nor lies in the workspace
    (a read-write mount there would cover the read-only one).

    Raises:
        ConfigurationError: naming ``what``.
    """
    path = Path(raw).resolve()
    if not path.is_dir():
        raise ConfigurationError(f"{what} folder {path} does not exist", field=what)
    if path == workspace or workspace in path.parents or path in workspace.parents:
        raise ConfigurationError(
            f"{what} folder {path} overlaps the read-only workspace", field=what
        )
    return path


def _run_bounded(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    extra: dict[str, Any],
    stdin: bytes | None,
    timeout: float,
    keep: int,
    tool: str,
) -> _Finished:
    """Run ``argv`` in its own process group: feed ``stdin``, digest both streams, keep
    ``keep`` bytes of each, kill the group at ``timeout``.

    Raises:
        AdapterError: the process could not be started (retryable=False: nothing ran).
    """
    try:
        proc = subprocess.Popen(  # noqa: S603 - an allow-listed program, no shell
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            **extra,
        )
    except (OSError, ValueError) as exc:
        raise AdapterError(
            f"tool {tool}: the command could not be started ({type(exc).__name__})",
            retryable=False,
            tool=tool,
        ) from None
    out, err = _Stream(keep), _Stream(keep)
    deadline = time.monotonic() + timeout
    try:
        timed_out = _pump(proc, stdin or b"", out, err, deadline=deadline)
    except BaseException:
        # The command started: whatever failed here, it must not outlive the call.
        _kill_group(proc)
        raise
    exit_status: int | None = None
    if not timed_out:
        try:
            exit_status = proc.wait(timeout=max(deadline - time.monotonic(), 0.001))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out:
        _kill_group(proc)
        exit_status = None
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    return _Finished(exit_status, timed_out, out, err)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the whole group (the command and what it started), before reaping the
    leader, so the group id cannot have been reused by then."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _pump(
    proc: subprocess.Popen[bytes], stdin: bytes, out: _Stream, err: _Stream, *, deadline: float
) -> bool:
    """Feed ``stdin`` and drain both output pipes until they close or ``deadline``
    passes; True when it passed."""
    pending = memoryview(stdin)
    with selectors.DefaultSelector() as selector:
        streams: dict[int, _Stream] = {}
        for pipe, stream in ((proc.stdout, out), (proc.stderr, err)):
            if pipe is not None:
                selector.register(pipe, selectors.EVENT_READ)
                streams[pipe.fileno()] = stream
        writer: IO[bytes] | None = proc.stdin
        if writer is not None:
            os.set_blocking(writer.fileno(), False)
            if pending:
                selector.register(writer, selectors.EVENT_WRITE)
            else:
                writer.close()
                writer = None
        try:
            while streams or writer is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return True
                for key, _ in selector.select(timeout=remaining):
                    fd = key.fd
                    if writer is not None and fd == writer.fileno():
                        try:
                            pending = pending[os.write(fd, pending[: 1 << 16]) :]
                        except BlockingIOError:
                            continue
                        except BrokenPipeError:
                            pending = pending[:0]  # the program stopped reading
                        if not pending:
                            selector.unregister(writer)
                            writer.close()
                            writer = None
                        continue
                    chunk = os.read(fd, 1 << 16)
                    if chunk:
                        streams[fd].feed(chunk)
                    else:  # EOF: every writer of that pipe closed it
                        selector.unregister(key.fileobj)
                        del streams[fd]
            return False
        finally:
            if writer is not None:
                with contextlib.suppress(OSError):
                    writer.close()
