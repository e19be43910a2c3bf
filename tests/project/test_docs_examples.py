"""Every task file, plan file and agent configuration the user-facing pages show loads
through the parser ``ratchet submit`` uses (``ratchet.ops.taskfile``), and the agent
configurations of built-in agents build: a page cannot drift from what the parser takes.

The blocks and their markers are described in ``tests/docs_blocks.py``. ``docs/mcp.md``
is left out: its YAML blocks are fragments without markers, kept as they are there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ratchet.agents import AgentPolicy
from ratchet.demo.examples import greeting_scenario
from ratchet.errors import ContractError
from ratchet.fleet.credentials import CredentialMap, CredentialSpec
from ratchet.fleet.runbuild import check_credentials
from ratchet.fleet.runs import RunDocument
from ratchet.ops.taskfile import load_plan_file, load_task_file
from ratchet.runtime import Scenario
from ratchet.runtime.canonical import strict_json_loads, strict_yaml_loads
from tests.docs_blocks import ROOT, Block, blocks, named

PAGES = [
    ROOT / "docs" / "task-file.md",
    ROOT / "docs" / "agents.md",
    ROOT / "docs" / "tools.md",
    ROOT / "docs" / "pydantic-ai.md",
    ROOT / "docs" / "mcp-cookbook.md",
    ROOT / "examples" / "tool-package" / "README.md",
]
TASK_KEYS = {"scenario", "scenario_file", "environment", "agent_config", "agent"}
SCENARIO_KEYS = set(Scenario.model_fields)
KNOWN_MARKS = {"fragment", "name", "task", "agent", "skip"}
BUILT_IN = {"greeting", "scripted", "tool_calling"}
# The credentials map docs/agents.md shows a worker holding (RATCHET_CREDENTIALS).
CREDENTIALS = CredentialMap(
    {"openai": CredentialSpec(env="OPENAI_API_KEY", destinations=("https://api.openai.com/v1",))}
)


def parsed(block: Block) -> Any:
    return strict_yaml_loads(block.text) if block.lang == "yaml" else strict_json_loads(block.text)


def kind_of(block: Block) -> str:
    """``task``, ``plan``, ``scenario`` (a fragment of one), ``broken`` (not strict YAML
    or JSON: the test fails on it) or ``other``."""
    if "skip" in block.marks:
        return "other"
    try:
        data = parsed(block)
    except ContractError:
        return "broken"
    if isinstance(data, list) or (isinstance(data, dict) and "steps" in data):
        return "plan"
    if isinstance(data, dict) and set(data) & TASK_KEYS:
        return "task"
    if isinstance(data, dict) and set(data) & SCENARIO_KEYS:
        return "scenario"
    return "other"


def data_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang in ("yaml", "json")]


def loaded_blocks() -> list[Block]:
    return [b for page in PAGES for b in data_blocks(page) if kind_of(b) != "other"]


def base_task() -> dict[str, Any]:
    """A whole task file a fragment completes."""
    return {
        "scenario": greeting_scenario().model_dump(mode="json"),
        "environment": {"root": "ws", "verifiers": {"unit": {"argv": ["python3", "test_app.py"]}}},
    }


def task_data(block: Block) -> dict[str, Any]:
    """The block as a whole task file: as written, or (a fragment) over the base task,
    the scenario's fields replacing the base's one by one, any other key whole."""
    data = parsed(block)
    if "fragment" not in block.marks:
        assert isinstance(data, dict)
        return data
    if kind_of(block) == "scenario":
        data = {"scenario": data}
    task = base_task()
    for key, value in data.items():
        if key == "scenario":
            task["scenario"] = {**task["scenario"], **value}
        else:
            task[key] = value
    return task


def write_task(block: Block, folder: Path) -> Path:
    """The task file a block stands for, in ``folder``: the block's own text when it is
    whole (the YAML parser reads what the page shows), else the completed fragment."""
    if "fragment" in block.marks:
        path = folder / "task.json"
        path.write_text(json.dumps(task_data(block)), encoding="utf-8")
    else:
        path = folder / f"task.{block.lang}"
        path.write_text(block.text, encoding="utf-8")
    return path


def load(block: Block, folder: Path, agent: str) -> RunDocument:
    document = load_task_file(write_task(block, folder), agent)
    if document.agent in BUILT_IN and document.agent != "scripted":
        check_credentials(document, CREDENTIALS)
        AgentPolicy(credentials=CREDENTIALS).build(document.agent, dict(document.agent_config))
    return document


@pytest.mark.parametrize("block", loaded_blocks(), ids=lambda b: b.where)
def test_every_task_and_plan_file_a_page_shows_loads_through_the_real_parser(
    block: Block, tmp_path: Path
) -> None:
    unknown = set(block.marks) - KNOWN_MARKS
    assert not unknown, f"{block.where}: unknown docs-test marks {sorted(unknown)}"
    kind = kind_of(block)
    if kind == "broken":
        parsed(block)  # raises: the page shows what the strict parser refuses
    if kind == "plan":
        plan = tmp_path / f"plan.{block.lang}"
        plan.write_text(block.text, encoding="utf-8")
        task_name = block.marks.get("task")
        if task_name:
            task = named(block.path, task_name)
            document = load(task, tmp_path, str(plan))
            assert document.agent == "scripted"
        else:
            assert load_plan_file(plan)
        return
    if kind == "scenario":
        assert "fragment" in block.marks, f"{block.where}: a scenario alone needs 'fragment'"
    agent = block.marks.get("agent") or "greeting"
    if task_data(block).get("agent_config") is None and agent == "greeting":
        agent = "scripted"  # nothing to configure: any agent name loads
    load(block, tmp_path, agent)


def test_each_page_has_blocks_the_test_loads() -> None:
    for page in PAGES:
        assert any(kind_of(b) != "other" for b in data_blocks(page)), page


def test_a_page_that_shows_an_agent_key_in_a_task_file_fails_the_check(tmp_path: Path) -> None:
    """The drift this test exists for: ``agent:`` is the command line's (``--agent``)."""
    page = tmp_path / "page.md"
    page.write_text("```yaml\n# docs-test: fragment\nagent: tool_calling\nagent_config: {}\n```\n")
    (block,) = blocks(page)
    assert kind_of(block) == "task"
    with pytest.raises(Exception, match="unknown key"):
        load_task_file(write_task(block, tmp_path), "greeting")
