"""Every bad task file gets one line: the strict task-file model, its loader, ``ratchet
submit`` on hostile files, ``ratchet schema task`` and the reference that documents it."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ratchet.cli import app
from ratchet.demo.examples import greeting_scenario, make_greeting_workspace
from ratchet.errors import ConfigurationError, ContractError, RatchetError
from ratchet.ops.taskfile import MAX_FILE_BYTES, load_task_file, task_file_schema
from ratchet.redis_server import RedisServer
from ratchet.runtime.canonical import strict_yaml_loads
from tests.worker.conftest import CHECKPOINT_KEY_HEX

ROOT = Path(__file__).resolve().parents[2]
RATCHET = [sys.executable, "-m", "ratchet.cli.entry"]
runner = CliRunner()


def valid_task() -> dict[str, Any]:
    return {
        "scenario": greeting_scenario().model_dump(mode="json"),
        "environment": {
            "root": "ws",
            "verifiers": {
                "unit": {"argv": [sys.executable, "test_app.py"], "timeout_seconds": 120}
            },
        },
        "agent_config": {"think_ms": 0},
    }


def write(folder: Path, name: str, content: Any) -> Path:
    path = folder / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    elif name.endswith((".yaml", ".yml")):
        path.write_text(yaml.safe_dump(content), encoding="utf-8")
    else:
        path.write_text(json.dumps(content), encoding="utf-8")
    return path


def edited(edit: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    task = valid_task()
    edit(task)
    return task


def anchor_bomb() -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, 10):
        refs = ", ".join([f"*a{level - 1}"] * 9)
        lines.append(f"a{level}: &a{level} [{refs}]")
    return "\n".join(lines) + "\n"


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


# (test id, file name, content, --agent, the field the one line must name)
HOSTILE: list[tuple[str, str, Any, str, str]] = [
    (
        "missing-scenario-field",
        "task.json",
        edited(lambda t: t["scenario"].pop("task_id")),
        "greeting",
        "scenario.task_id",
    ),
    (
        "ill-typed-scenario-field",
        "task.json",
        edited(lambda t: t["scenario"]["budgets"].__setitem__("proposals", "30")),
        "greeting",
        "scenario.budgets.proposals",
    ),
    (
        "bool-as-int",
        "task.json",
        edited(lambda t: t["scenario"]["budgets"].__setitem__("steps", True)),
        "greeting",
        "scenario.budgets.steps",
    ),
    (
        "bool-as-schema-version",
        "task.json",
        edited(lambda t: t["scenario"].__setitem__("schema_version", True)),
        "greeting",
        "scenario.schema_version",
    ),
    (
        "traversing-allowed-path",
        "task.json",
        edited(lambda t: t["scenario"].__setitem__("allowed_paths", ["../app.py"])),
        "greeting",
        "scenario.allowed_paths[0]",
    ),
    (
        "missing-scenario-file",
        "task.json",
        edited(lambda t: (t.pop("scenario"), t.__setitem__("scenario_file", "nope.yaml"))),
        "greeting",
        "scenario_file",
    ),
    (
        "scenario-file-is-a-folder",
        "task.json",
        edited(lambda t: (t.pop("scenario"), t.__setitem__("scenario_file", "."))),
        "greeting",
        "scenario_file",
    ),
    (
        "deep-nesting",
        "task.json",
        edited(lambda t: t.__setitem__("agent_config", {"deep": nested(100)})),
        "greeting",
        "agent_config.deep",
    ),
    (
        "yaml-on-in-a-string-field",
        "task.yaml",
        yaml.safe_dump(valid_task()).replace("task_id: fix-greeting", "task_id: on"),
        "greeting",
        "scenario.task_id",
    ),
    (
        "yaml-yes-in-a-bool-field",
        "task.yaml",
        yaml.safe_dump(
            edited(
                lambda t: t["environment"]["verifiers"]["unit"].__setitem__("network", "NETWORK")
            )
        ).replace("NETWORK", "yes"),
        "greeting",
        "environment.verifiers.unit.network",
    ),
    ("anchor-bomb", "task.yaml", anchor_bomb(), "greeting", "a1[0]"),
    (
        "agent-config-as-pairs",
        "task.json",
        edited(lambda t: t.__setitem__("agent_config", [["a", 1]])),
        "greeting",
        "agent_config",
    ),
    (
        "unknown-top-level-key",
        "task.json",
        edited(lambda t: t.__setitem__("scenarios", {})),
        "greeting",
        "scenarios",
    ),
    (
        "both-scenario-and-file",
        "task.json",
        edited(lambda t: t.__setitem__("scenario_file", "s.json")),
        "greeting",
        "scenario",
    ),
    (
        "oversize-file",
        "task.json",
        b'{"agent_config": {"pad": "' + b"x" * MAX_FILE_BYTES + b'"}}',
        "greeting",
        "task_file",
    ),
    ("not-utf-8", "task.json", b'{"scenario": "\xff\xfe"}', "greeting", "task_file"),
    ("not-an-object", "task.json", "[1, 2]", "greeting", "task_file"),
    ("duplicate-key", "task.json", '{"scenario": {}, "scenario": {}}', "greeting", "scenario"),
    (
        "float",
        "task.json",
        json.dumps(valid_task()).replace('"cost_units": 0', '"cost_units": 0.5'),
        "greeting",
        "scenario.budgets.cost_units",
    ),
    (
        "missing-plan-file",
        "task.json",
        edited(lambda t: t.pop("agent_config")),
        "missing-plan.yaml",
        "agent",
    ),
]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    make_greeting_workspace(tmp_path / "ws")
    return tmp_path


def test_the_valid_task_file_loads_from_json_and_yaml_with_paths_from_its_own_folder(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(folder / "ws")  # the working directory never decides a path
    from_json = load_task_file(write(folder, "task.json", valid_task()), "greeting")
    from_yaml = load_task_file(write(folder, "task.yml", valid_task()), "greeting")
    assert from_json == from_yaml
    assert from_json.environment.root == str((folder / "ws").resolve())
    assert from_json.agent_config == {"think_ms": 0}
    assert from_json.scenario == greeting_scenario()


def test_a_scenario_file_and_a_plan_file_are_read_like_the_task_file(folder: Path) -> None:
    (folder / "specs").mkdir()
    write(folder / "specs", "scenario.yaml", valid_task()["scenario"])
    task = edited(
        lambda t: (
            t.pop("scenario"),
            t.pop("agent_config"),
            t.__setitem__("scenario_file", "specs/scenario.yaml"),
        )
    )
    plan = write(
        folder,
        "plan.yaml",
        {
            "steps": [
                {"kind": "read_file", "args": {"path": "app.py"}},
                {"kind": "finish", "args": {"summary": "done"}},
            ]
        },
    )
    document = load_task_file(write(folder, "task.json", task), str(plan))
    assert document.scenario == greeting_scenario()
    assert document.agent == "scripted"
    assert document.agent_config == {
        "steps": [
            {"kind": "read_file", "args": {"path": "app.py"}},
            {"kind": "finish", "args": {"summary": "done"}},
        ]
    }


def test_a_plan_file_beside_an_agent_config_is_refused_rather_than_half_used(folder: Path) -> None:
    plan = write(folder, "plan.json", [{"kind": "finish", "args": {"summary": "done"}}])
    with pytest.raises(ContractError) as caught:
        load_task_file(write(folder, "task.json", valid_task()), str(plan))
    assert caught.value.field == "agent_config"


@pytest.mark.parametrize(
    ("step", "field"),
    [
        ({"kind": "read_file", "args": {"path": "../secret"}}, "steps[0]"),
        ({"kind": "read_file"}, "steps[0]"),
        ({"kind": "launch_missiles", "args": {}}, "steps[0].kind"),
        ({"kind": "finish", "args": {"summary": 1}}, "steps[0].args.summary"),
        ({"kind": "9lives", "args": {}}, "steps[0].kind"),
        ({"kind": "delete_file", "args": {"path": "app.py"}}, "steps[0].kind"),
        ({"kind": "tickets_create_ticket", "args": {"title": "t"}}, "steps[0].kind"),
    ],
)
def test_a_bad_plan_step_is_refused_at_submit_naming_the_step(
    folder: Path, step: dict[str, Any], field: str
) -> None:
    plan = write(folder, "plan.json", [step])
    task = edited(lambda t: t.pop("agent_config"))
    with pytest.raises(ContractError) as caught:
        load_task_file(write(folder, "task.json", task), str(plan))
    assert caught.value.field == field


def test_a_plan_step_may_name_a_declared_tool_the_scenario_permits_with_json_arguments(
    folder: Path,
) -> None:
    """The scripted agent proposes a tool by name (``make_action``); a plan file says so
    too, and its arguments are the tool's JSON arguments, kept exactly as written."""
    task = edited(lambda t: t.pop("agent_config"))
    task["scenario"]["permissions"] = [*task["scenario"]["permissions"], "tickets_create_ticket"]
    steps = [
        {"kind": "tickets_create_ticket", "args": {"title": "Printer", "body": "3rd", "n": 2}},
        {"kind": "finish", "args": {"summary": "filed"}},
    ]
    plan = write(folder, "plan.yaml", {"steps": steps})
    document = load_task_file(write(folder, "task.json", task), str(plan))
    assert document.agent == "scripted"
    assert document.agent_config == {"steps": steps}


@pytest.mark.parametrize(
    ("name", "content", "agent", "field"),
    [case[1:] for case in HOSTILE],
    ids=[case[0] for case in HOSTILE],
)
def test_a_hostile_task_file_is_one_line_on_stderr_naming_the_field_with_exit_2(
    folder: Path, name: str, content: Any, agent: str, field: str
) -> None:
    path = write(folder, name, content)
    with pytest.raises((ContractError, ConfigurationError)) as caught:
        load_task_file(path, agent)
    named = str(caught.value.field)
    assert named == field or named.startswith((f"{field}.", f"{field}["))  # deep: cut short
    assert "\n" not in caught.value.message
    result = runner.invoke(
        app,
        ["submit", str(path), "--agent", agent],
        env={"RATCHET_REDIS_URL": "redis://127.0.0.1:1/0"},
    )
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ratchet: error: ")
    assert lines[0].endswith(f"(field: {named})")
    assert "Traceback" not in result.stderr


def test_a_folder_given_as_the_task_file_is_one_line(folder: Path) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_task_file(folder, "greeting")
    assert caught.value.field == "task_file"
    assert "folder" in caught.value.message


def test_the_anchor_bomb_is_refused_at_its_first_alias_without_expanding_it() -> None:
    with pytest.raises(ContractError, match="aliases are not allowed") as caught:
        strict_yaml_loads(anchor_bomb())
    assert caught.value.field == "a1[0]"


@pytest.mark.parametrize(
    "plain", ["on", "off", "yes", "No", "012", "0x1f", "1_000", "1:30", "1e3", "<<"]
)
def test_yaml_values_that_1_1_and_1_2_read_differently_are_refused_unless_quoted(
    plain: str,
) -> None:
    with pytest.raises(ContractError, match="quote it") as caught:
        strict_yaml_loads(f"policy:\n  id: {plain}\n")
    assert caught.value.field == "policy.id"
    assert strict_yaml_loads(f"policy:\n  id: '{plain}'\n") == {"policy": {"id": plain}}


# --- the real command line -----------------------------------------------------------------


@pytest.fixture
def env(redis_server: RedisServer, tmp_path: Path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    out.update(
        RATCHET_REDIS_URL=redis_server.url,
        RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX,
        RATCHET_QUEUE=f"tf-{tmp_path.name}",
        RATCHET_LOG_LEVEL="WARNING",
    )
    return out


def ratchet(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RATCHET, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_hostile_files_through_the_real_cli_change_nothing_stored(
    env: dict[str, str], folder: Path, redis_server: RedisServer
) -> None:
    submitted = ratchet(
        "submit", str(write(folder, "good.yaml", valid_task())), "--json", env=env, cwd=folder
    )
    assert submitted.returncode == 0, submitted.stderr
    assert json.loads(submitted.stdout)["run_id"]
    client = redis_server.client()

    def stored() -> dict[bytes, bytes | None]:
        return {key: client.dump(key) for key in sorted(client.keys("*"))}

    before = stored()
    picked = {
        "agent-config-as-pairs",
        "yaml-on-in-a-string-field",
        "anchor-bomb",
        "oversize-file",
        "missing-scenario-file",
        "bool-as-int",
    }
    for case_id, name, content, agent, field in HOSTILE:
        if case_id not in picked:
            continue
        done = ratchet(
            "submit", str(write(folder, name, content)), "--agent", agent, env=env, cwd=folder
        )
        assert done.returncode == 2, (case_id, done.stderr)
        assert done.stdout == ""
        assert len(done.stderr.splitlines()) == 1, (case_id, done.stderr)
        assert f"(field: {field})" in done.stderr and "Traceback" not in done.stderr
    assert stored() == before


# --- ratchet schema task and the reference ------------------------------------------------------


def test_schema_task_prints_only_the_json_schema_generated_from_the_model() -> None:
    result = runner.invoke(app, ["schema", "task"])
    assert result.exit_code == 0, result.output
    schema = json.loads(result.stdout)
    assert schema == task_file_schema()
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {"scenario", "scenario_file", "environment", "agent_config"}
    assert {"task_id", "budgets", "verifier"} <= set(schema["$defs"]["Scenario"]["properties"])
    assert schema["oneOf"] == [{"required": ["scenario"]}, {"required": ["scenario_file"]}]


def test_the_reference_mentions_every_field_the_schema_has() -> None:
    doc = (ROOT / "docs" / "task-file.md").read_text(encoding="utf-8")
    schema = task_file_schema()
    names = set(schema["properties"])
    for definition in schema["$defs"].values():
        names |= set(definition.get("properties", {}))
    missing = sorted(name for name in names if f"`{name}`" not in doc)
    assert not missing, f"docs/task-file.md does not mention {missing}"
    assert "ratchet schema task" in doc


# --- the property: a mutated task file is a document or one typed line -----------------------

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=12),
    st.sampled_from(
        ["on", "yes", "012", "../x", "/abs", "", "\x00", "\ud800", "1:30", "app.py", "unit"]
    ),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


def _mutate(task: dict[str, Any], path: tuple[Any, ...], how: str, junk: Any, depth: int) -> Any:
    if not path:
        return junk if how == "replace" else task
    parent: Any = task
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if how == "drop":
        del parent[last]
    elif how == "replace":
        parent[last] = junk
    elif how == "nest":
        parent[last] = nested(depth) if depth % 2 else {"x": nested(depth)}
    elif how == "rename" and isinstance(parent, dict):
        parent[f"{last}_"] = parent.pop(last)
    elif how == "insert" and isinstance(parent, dict):
        parent["unexpected"] = junk
    elif how == "insert" and isinstance(parent, list):
        parent.append(junk)
    return task


@st.composite
def mutated_files(draw: st.DrawFn) -> tuple[str, bytes]:
    task = valid_task()
    mutations = draw(st.integers(min_value=1, max_value=3))
    for _ in range(mutations):
        paths = list(_paths(task)) if isinstance(task, dict) else [()]
        path = draw(st.sampled_from(paths))
        how = draw(st.sampled_from(["drop", "replace", "nest", "rename", "insert"]))
        task = _mutate(task, path, how, draw(JUNK), draw(st.integers(1, 120)))
        if not isinstance(task, dict):
            break
    fmt = draw(st.sampled_from(["json", "yaml", "yaml-text"]))
    if fmt == "json":
        text = json.dumps(task)
    else:
        try:
            text = yaml.safe_dump(copy.deepcopy(task), allow_unicode=False)
        except yaml.YAMLError:
            text = json.dumps(task)
        if fmt == "yaml-text":  # YAML 1.1 spellings, anchors, stray text, a cut-off file
            swap = draw(
                st.sampled_from(
                    [
                        ("'on'", "on"),
                        ("true", "yes"),
                        ("120", "0120"),
                        ("- ", "- &a "),
                        ("ws", "*a"),
                        (": ", ":: "),
                    ]
                )
            )
            text = text.replace(*swap, 1)
            text = (
                text[: draw(st.integers(min_value=0, max_value=len(text)))]
                if draw(st.booleans())
                else text
            )
    raw = text.encode("utf-8", "surrogatepass")
    if draw(st.integers(0, 20)) == 0:
        raw += b"\xff"
    return ("task.json" if fmt == "json" else "task.yaml"), raw


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as name:
        make_greeting_workspace(Path(name) / "ws")
        yield Path(name)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_files())
def test_a_mutated_task_file_is_a_document_or_one_typed_line_never_a_traceback(
    scratch: Path, case: tuple[str, bytes]
) -> None:
    name, raw = case
    path = scratch / name
    path.write_bytes(raw)
    try:
        document = load_task_file(path, "greeting")
    except RatchetError as exc:
        assert isinstance(exc, ContractError | ConfigurationError)
        assert "\n" not in exc.message and exc.message.strip() == exc.message
        assert exc.field
        assert re.match(r"^\S", exc.message)
    else:
        assert document.environment.root.startswith("/")


def test_a_tools_task_file_has_no_root_and_answers_its_targets_with_checks(
    tmp_path: Path,
) -> None:
    scenario = greeting_scenario().model_dump(mode="json")
    scenario.update(permissions=["run_verifier", "finish"], allowed_paths=[], initial_files={})
    scenario["verifier"] = {"target": "unit"}
    check = {"tool": "order_status", "arguments": {"order_id": "o1"}, "expect": {"ok": True}}
    task = {"scenario": scenario, "environment": {"kind": "tools", "checks": {"unit": check}}}
    path = tmp_path / "task.json"
    path.write_text(json.dumps(task))
    document = load_task_file(path, "scripted")
    env = document.environment
    assert env.kind == "tools" and env.root is None and env.checks["unit"].tool == "order_status"
    for bad, where in (
        ({"kind": "tools", "root": "."}, "no root"),
        ({"kind": "tools", "verifiers": {"unit": {"argv": ["true"]}}}, "no verifier command"),
        ({"kind": "workspace", "checks": {"unit": check}}, "belong to a tools environment"),
    ):
        path.write_text(json.dumps({**task, "environment": bad}))
        with pytest.raises(ContractError, match=where):
            load_task_file(path, "scripted")
