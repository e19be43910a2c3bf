"""The task file ``ratchet submit`` reads: one strict model and the loader that turns a file
into a :class:`~ratchet.fleet.runs.RunDocument`.

A task file is one JSON or YAML object (YAML when the name ends in ``.yaml`` or ``.yml``,
JSON otherwise) with these keys and no others (``docs/task-file.md`` is the reference;
``ratchet schema task`` prints the JSON Schema generated from :class:`TaskFile`):

- ``scenario``: the task contract (:class:`ratchet.runtime.Scenario`), or
  ``scenario_file``: a JSON or YAML file holding it. Exactly one of the two.
- ``environment`` (optional): the workspace ``root`` (default: the task file's folder) or,
  with ``kind: git``, the git ``remote`` whose branch holds the run's files; the
  allow-listed verifier commands, an HTTP API for external calls.
- ``agent_config`` (optional): the agent's configuration, a JSON object.

Relative paths in a task file (``scenario_file``, ``environment.root``) are resolved
against the folder the task file is in, never the working directory. The agent comes from
the command line: a name, ``package.module:factory``, or a plan file (a name ending in
``.json``, ``.yaml`` or ``.yml``, relative to the working directory) whose steps the
``scripted`` agent plays; a plan file replaces ``agent_config``, so a task file that has
one too is refused rather than half used.

Reading is bounded and strict: every file is a regular file of at most
:data:`MAX_FILE_BYTES`, UTF-8, parsed by the strict JSON/YAML parsers (no duplicate keys,
floats, YAML 1.1 booleans or aliases; nesting at most 64 deep) and validated without
coercion (a boolean is not an integer, a list of pairs is not an object, a string is not
a number). Every failure is one error whose message is one line that starts with the file
and then the field path inside it (``task.yaml: scenario.budgets.proposals: input should
be a valid integer``), and whose ``field`` is that path: :class:`ConfigurationError` for a
file that cannot be read, :class:`ContractError` for what a file holds.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ratchet.errors import ConfigurationError, ContractError
from ratchet.fleet.runs import EnvironmentSpec, RunDocument
from ratchet.runtime import KIND_SPECS, ActionKind, Scenario
from ratchet.runtime.actions import Kind
from ratchet.runtime.canonical import json_path, strict_json_loads, strict_yaml_loads
from ratchet.runtime.types import Frozen, JsonObject, StrictStr, check_rel_path

__all__ = [
    "MAX_FILE_BYTES",
    "PLAN_SUFFIXES",
    "PlanFile",
    "PlanStep",
    "TaskEnvironment",
    "TaskFile",
    "is_plan_file",
    "load_plan_file",
    "load_task_file",
    "plan_file_schema",
    "task_file_schema",
]

#: The most a task file, its scenario file or a plan file may hold (the checkpoint cap).
MAX_FILE_BYTES = 1 << 20
#: An ``--agent`` value ending in one of these names a plan file.
PLAN_SUFFIXES = (".json", ".yaml", ".yml")
_YAML_SUFFIXES = (".yaml", ".yml")
_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_SHOWN_PATH = 200  # characters of a file name quoted in a message

_PathText = Annotated[str, Strict(), Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]
_ArgText = Annotated[str, Strict(), Field(max_length=1 << 20)]
#: A built-in kind's arguments: strings only.
_BUILTIN_ARGS: TypeAdapter[dict[str, str]] = TypeAdapter(dict[StrictStr, _ArgText])
_M = TypeVar("_M", bound=BaseModel)


def _never_null(schema: dict[str, Any]) -> None:
    """In the schema, a key that may be left out but is never null: no null, no default."""
    schema.pop("default", None)
    options = [option for option in schema.pop("anyOf", []) if option != {"type": "null"}]
    if len(options) == 1:
        schema.update(options[0])
    elif options:
        schema["anyOf"] = options


class TaskEnvironment(EnvironmentSpec):
    """The run's environment as a task file writes it: ``root`` (the workspace folder) may
    be relative to the task file's folder and defaults to that folder; a git environment
    (``kind: git``) names its ``remote`` instead and has no root."""

    root: _PathText | None = Field(default=None, json_schema_extra=_never_null)

    @model_validator(mode="after")
    def _one_place(self) -> TaskEnvironment:
        if self.kind == "git" and self.root is not None:
            raise ValueError("a git environment has no root: its files are on the remote's branch")
        if self.kind == "tools" and self.root is not None:
            raise ValueError("a tools environment has no root: it has no folder")
        if (self.kind == "git") != (self.remote is not None):
            raise ValueError("environment.remote is needed by, and only by, kind: git")
        return self


class TaskFile(Frozen):
    """A task file: the scenario (inline or in its own file), the environment and the
    agent's configuration. Unknown keys are refused."""

    model_config = ConfigDict(
        title="ratchet task file",
        json_schema_extra={"oneOf": [{"required": ["scenario"]}, {"required": ["scenario_file"]}]},
    )

    scenario: Scenario | None = Field(
        default=None,
        json_schema_extra=_never_null,
        description="The task contract. Exactly one of scenario and scenario_file.",
    )
    scenario_file: _PathText | None = Field(
        default=None,
        json_schema_extra=_never_null,
        description="A JSON or YAML file holding the scenario, relative to the task file's "
        "folder. Exactly one of scenario and scenario_file.",
    )
    environment: TaskEnvironment = Field(
        default_factory=TaskEnvironment, description="Where the run's effects happen."
    )
    agent_config: JsonObject = Field(
        default_factory=dict,
        description="The agent's configuration, handed to its "
        "factory as a JSON object. Refused with a plan file.",
    )

    @field_validator("scenario", "scenario_file", mode="before")
    @classmethod
    def _not_null(cls, value: object) -> object:
        # None stands for "left out"; a null written out is refused, not taken for that.
        if value is None:
            raise ValueError("must not be null; leave the key out instead")
        return value

    @model_validator(mode="after")
    def _one_scenario(self) -> TaskFile:
        if (self.scenario is None) == (self.scenario_file is None):
            raise ValueError("give exactly one of scenario and scenario_file")
        return self


class PlanStep(Frozen):
    """One step of a plan: a built-in action kind and exactly the arguments that kind
    takes (all strings), or the name of a declared tool and its JSON arguments. A tool's
    arguments are checked against its schema when the step is proposed (the tool is the
    worker's, not the file's); :func:`load_task_file` checks that the scenario permits
    it."""

    kind: Kind
    args: JsonObject = Field(default_factory=dict)

    @field_validator("args")
    @classmethod
    def _strings_for_a_kind(cls, args: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if isinstance(info.data.get("kind"), ActionKind):
            # Raised from here, a ValidationError keeps its place under ``args``
            # (``steps[0].args.summary``).
            _BUILTIN_ARGS.validate_python(args)
        return args

    @model_validator(mode="after")
    def _kind_args(self) -> PlanStep:
        if not isinstance(self.kind, ActionKind):
            return self  # a declared tool's arguments: its schema is the worker's
        spec = KIND_SPECS[self.kind]
        if set(self.args) != spec.args:
            raise ValueError(f"{self.kind} takes exactly the args {sorted(spec.args)}")
        for name in sorted(spec.path_args):
            try:
                check_rel_path(str(self.args[name]))
            except ValueError as exc:
                raise ValueError(f"args.{name}: {exc}") from None
        return self


class PlanFile(Frozen):
    """A plan file: the steps the ``scripted`` agent plays, in order (a bare list of steps
    is read as ``{"steps": [...]}``)."""

    model_config = ConfigDict(title="ratchet plan file")

    steps: list[PlanStep] = Field(min_length=1, max_length=10_000)


def task_file_schema() -> dict[str, Any]:
    """The JSON Schema of a task file, generated from :class:`TaskFile`."""
    return {"$schema": _SCHEMA_DIALECT, **TaskFile.model_json_schema()}


def plan_file_schema() -> dict[str, Any]:
    """The JSON Schema of a plan file, generated from :class:`PlanFile`."""
    return {"$schema": _SCHEMA_DIALECT, **PlanFile.model_json_schema()}


# --- reading ---------------------------------------------------------------------------------


def _name(path: Path | str) -> str:
    """A file name for a message: as given, quoted if it is not plain, on one line."""
    text = str(path)
    if text.isprintable() and " " not in text and len(text) <= _SHOWN_PATH:
        return text
    quoted = json.dumps(text)
    return quoted if len(quoted) <= _SHOWN_PATH else quoted[: _SHOWN_PATH - 4] + '..."'


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _read_bytes(path: Path, what: str, field: str) -> bytes:
    """At most MAX_FILE_BYTES of a regular file. Opened non-blocking, so a FIFO named in a
    task file refuses instead of hanging; the type and size are checked on the open file."""
    name = _name(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigurationError(
            f"{name}: cannot read the {what}: {_one_line(reason)}", field=field
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise ConfigurationError(f"{name}: the {what} is {kind}", field=field)
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigurationError(
            f"{name}: cannot read the {what}: {_one_line(exc.strerror or str(exc))}", field=field
        ) from None
    finally:
        os.close(fd)
    if size > MAX_FILE_BYTES:
        raise ContractError(
            f"{name}: the {what} is larger than {MAX_FILE_BYTES} bytes", field=field
        )
    return b"".join(chunks)


def _read_structured(path: Path, what: str, field: str) -> Any:
    """The strictly parsed content of a JSON or YAML file (by suffix)."""
    raw = _read_bytes(path, what, field)
    name = _name(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ContractError(
            f"{name}: the {what} is not UTF-8 text (byte "
            f"0x{raw[exc.start]:02x} at offset {exc.start})",
            field=field,
        ) from None
    try:
        if path.suffix.lower() in _YAML_SUFFIXES:
            return strict_yaml_loads(text)
        return strict_json_loads(text)
    except ContractError as exc:
        where = exc.field or "$"
        raise ContractError(
            f"{name}: {_one_line(exc.message)}", field=field if where == "$" else where
        ) from None


def _message(error: Any) -> str:
    kind = error.get("type")
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown key, not part of the format"
    text = _one_line(str(error.get("msg", "invalid")))
    for prefix in ("Value error, ", "Assertion failed, "):
        text = text.removeprefix(prefix)
    return text[:1].lower() + text[1:]


def _validated(model: type[_M], data: Any, name: str, *, top: str = "") -> _M:
    """``model`` validated from ``data``; a failure is one ContractError naming the first
    problem's field path."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        loc = [part for part in error["loc"] if part != "[key]"]
        path = json_path(loc)
        if path == "$" and top:
            path = top
        what = _message(error)
        if "[key]" in error["loc"]:
            what = f"key: {what}"
        if error.get("type") == "extra_forbidden" and len(loc) == 1 and model is TaskFile:
            what = "unknown key; a task file has scenario, scenario_file, environment, agent_config"
        raise ContractError(f"{name}: {path}: {what}", field=path) from None
    except RecursionError:
        raise ContractError(f"{name}: nests too deeply to validate", field=top or "$") from None


def _resolve(base: Path, text: str, name: str, field: str) -> Path:
    """``text`` as an absolute path: relative ones against ``base`` (the task file's
    folder)."""
    try:
        return (base / text).resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        raise ConfigurationError(
            f"{name}: {field}: cannot resolve the path: {_one_line(str(exc))}", field=field
        ) from None


def is_plan_file(agent: str) -> bool:
    """Whether an ``--agent`` value names a plan file (by its suffix)."""
    return agent.lower().endswith(PLAN_SUFFIXES)


def load_plan_file(path: Path) -> list[dict[str, Any]]:
    """The steps of a plan file, as the ``scripted`` agent's configuration holds them.

    Raises:
        ConfigurationError: the file cannot be read (``field="agent"``).
        ContractError: what it holds is not a plan (``field`` is the path inside it).
    """
    data = _read_structured(path, "plan file", "agent")
    plan = _validated(
        PlanFile, {"steps": data} if isinstance(data, list) else data, _name(path), top="agent"
    )
    return [step.model_dump(mode="json") for step in plan.steps]


def _check_permitted(steps: list[dict[str, Any]], scenario: Scenario, name: str) -> None:
    """Every step names a kind or a tool the scenario permits: a step that is not would
    be refused at every proposal until the run's budget ran out.

    Raises:
        ContractError: naming the first such step (``steps[i].kind``).
    """
    permitted = {str(kind) for kind in scenario.permissions}
    for index, step in enumerate(steps):
        if step["kind"] not in permitted:
            field = f"steps[{index}].kind"
            raise ContractError(
                f"{name}: {field}: the scenario does not permit {step['kind']!r} "
                "(add it to scenario.permissions)",
                field=field,
            )


def load_task_file(path: Path, agent: str) -> RunDocument:
    """Read, strictly, the task file at ``path`` (and the scenario file and plan file it
    leads to) into the run document ``ratchet submit`` seals. ``agent`` is the
    ``--agent`` value: an agent name, or a plan file (see :func:`is_plan_file`).

    Nothing is stored or started here: the document still goes through
    :func:`ratchet.ops.submit`, which loads the agent and checks the environment.

    Raises:
        ConfigurationError: a file cannot be read, is a folder or not a regular file; a
            path cannot be resolved.
        ContractError: a file is too large, not UTF-8, not strict JSON/YAML, or what it
            holds breaks the task-file, scenario or plan format. The message is one line
            starting with the file and the field path; ``field`` is that path.
    """
    name = _name(path)
    data = _read_structured(path, "task file", "task_file")
    if not isinstance(data, dict):
        raise ContractError(
            f"{name}: the task file must hold an object (scenario, environment, agent_config)",
            field="task_file",
        )
    if ("scenario" in data) == ("scenario_file" in data):
        raise ContractError(
            f"{name}: scenario: give exactly one of scenario and scenario_file", field="scenario"
        )
    task = _validated(TaskFile, data, name, top="task_file")
    base = _resolve(Path(), str(path), name, "task_file").parent  # its own folder
    scenario = task.scenario
    if scenario is None:
        if task.scenario_file is None:  # for the type checker: the model requires one
            raise ContractError(f"{name}: scenario: missing", field="scenario")
        scenario_path = _resolve(base, task.scenario_file, name, "scenario_file")
        scenario = _validated(
            Scenario,
            _read_structured(scenario_path, "scenario file", "scenario_file"),
            _name(scenario_path),
            top="scenario",
        )
    agent_name = agent
    agent_config: dict[str, Any] = dict(task.agent_config)
    if is_plan_file(agent):
        if "agent_config" in data:
            raise ContractError(
                f"{name}: agent_config: a plan file ({_name(agent)}) "
                "replaces agent_config; keep one of them",
                field="agent_config",
            )
        steps = load_plan_file(Path(agent))
        _check_permitted(steps, scenario, _name(agent))
        agent_name, agent_config = "scripted", {"steps": steps}
    environment = task.environment.model_dump(mode="json")
    if task.environment.kind == "workspace":
        root = _resolve(base, task.environment.root or ".", name, "environment.root")
        environment["root"] = str(root)
    return _validated(
        RunDocument,
        {
            "scenario": scenario,
            "agent": agent_name,
            "agent_config": agent_config,
            "environment": _validated(EnvironmentSpec, environment, name, top="environment"),
        },
        name,
        top="task_file",
    )
