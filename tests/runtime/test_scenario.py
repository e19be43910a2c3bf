"""Strict loading of the task contract: every malformed input is a typed, named error."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ratchet.errors import ScenarioError
from ratchet.runtime import Scenario, load_scenario
from tests.runtime.world import scenario_data


def dump(data: dict[str, Any]) -> str:
    return json.dumps(data)


def test_a_valid_scenario_loads_from_json_and_yaml_with_the_same_fingerprint() -> None:
    import yaml

    data = scenario_data()
    from_json = load_scenario(dump(data))
    from_yaml = load_scenario(yaml.safe_dump(data), fmt="yaml")
    assert from_json == from_yaml
    assert from_json.fingerprint == from_yaml.fingerprint
    assert len(from_json.fingerprint) == 64


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"task_version": "2"}, "task_version"),
        ({"policy_version": "4"}, "policy_version"),
        ({"permissions": ["read_file", "run_verifier", "finish", "external_call"]}, "permissions"),
        ({"allowed_paths": ["app.py"]}, "allowed_paths"),
        ({"initial_files": {"app.py": "print('hi')\n"}}, "initial_files"),
        ({"approval_required": []}, "approval_required"),
    ],
)
def test_the_fingerprint_covers_every_part_of_the_contract(
    change: dict[str, Any], field: str
) -> None:
    base = load_scenario(dump(scenario_data()))
    changed = load_scenario(dump(scenario_data(**change)))
    assert base.fingerprint != changed.fingerprint, field


def test_an_unknown_field_is_refused_by_name() -> None:
    with pytest.raises(ScenarioError) as err:
        load_scenario(dump(scenario_data(surprise=1)))
    assert err.value.field == "surprise"


def test_a_missing_field_is_refused_by_name() -> None:
    data = scenario_data()
    del data["budgets"]
    with pytest.raises(ScenarioError) as err:
        load_scenario(dump(data))
    assert err.value.field == "budgets"


def test_a_nested_unknown_field_names_its_path() -> None:
    data = scenario_data()
    data["budgets"]["tokens"] = 5
    with pytest.raises(ScenarioError) as err:
        load_scenario(dump(data))
    assert err.value.field == "budgets.tokens"


def test_duplicate_keys_in_json_are_refused() -> None:
    text = dump(scenario_data())[:-1] + ', "task_id": "other"}'
    with pytest.raises(ScenarioError) as err:
        load_scenario(text)
    assert err.value.field == "task_id"


def test_duplicate_keys_in_yaml_are_refused() -> None:
    text = "schema_version: 1\ntask_id: a\ntask_id: b\n"
    with pytest.raises(ScenarioError) as err:
        load_scenario(text, fmt="yaml")
    assert err.value.field == "task_id"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1.5"])
def test_non_finite_and_floating_numbers_are_refused(literal: str) -> None:
    text = dump(scenario_data()).replace('"cost_units": 1000', f'"cost_units": {literal}')
    assert literal in text
    with pytest.raises(ScenarioError):
        load_scenario(text)


def test_floats_in_yaml_are_refused() -> None:
    import yaml

    data = scenario_data()
    data["budgets"]["cost_units"] = 2.5
    with pytest.raises(ScenarioError):
        load_scenario(yaml.safe_dump(data), fmt="yaml")


@pytest.mark.parametrize("field", ["proposals", "steps", "wall_clock_seconds", "cost_units"])
def test_a_boolean_where_an_integer_belongs_is_refused(field: str) -> None:
    data = scenario_data()
    data["budgets"][field] = True
    with pytest.raises(ScenarioError) as err:
        load_scenario(dump(data))
    assert err.value.field == f"budgets.{field}"


@pytest.mark.parametrize(
    "path",
    [
        "../etc/passwd",
        "/abs/app.py",
        "a//b",
        "a/./b",
        "a/../b",
        "a\\b",
        "docs/",
        "",
        ".",
        "cafe\u0301.py",
        "sp ace.py",
    ],
)
def test_non_canonical_or_traversing_paths_are_refused(path: str) -> None:
    with pytest.raises(ScenarioError) as err:
        load_scenario(dump(scenario_data(allowed_paths=["app.py", path])))
    assert err.value.field.startswith("allowed_paths")


def test_a_step_budget_above_the_proposal_budget_is_refused() -> None:
    budgets = {"proposals": 3, "steps": 4, "wall_clock_seconds": 60, "cost_units": 0}
    with pytest.raises(ScenarioError, match="steps exceeds"):
        load_scenario(dump(scenario_data(budgets=budgets)))


@pytest.mark.parametrize(
    "field", ["permissions", "allowed_paths", "allowed_verifier_targets", "approval_required"]
)
def test_duplicates_in_lists_are_refused(field: str) -> None:
    data = scenario_data()
    data[field] = [*data[field], data[field][0]] if data[field] else ["external_call"] * 2
    with pytest.raises(ScenarioError, match="duplicate"):
        load_scenario(dump(data))


def test_expected_files_outside_the_allowed_paths_are_refused() -> None:
    verifier = {"target": "unit", "expected_files": {"secrets.txt": "x"}}
    with pytest.raises(ScenarioError, match="outside allowed_paths"):
        load_scenario(dump(scenario_data(verifier=verifier)))


def test_a_verifier_target_outside_the_allowlist_is_refused() -> None:
    verifier = {"target": "integration", "expected_files": {}}
    with pytest.raises(ScenarioError, match="allowed_verifier_targets"):
        load_scenario(dump(scenario_data(verifier=verifier)))


def test_approval_for_a_kind_that_is_not_permitted_is_refused() -> None:
    with pytest.raises(ScenarioError, match="not permitted") as err:
        load_scenario(
            dump(
                scenario_data(permissions=["read_file", "finish"], approval_required=["write_file"])
            )
        )
    assert err.value.field == "approval_required"


@pytest.mark.parametrize("kind", ["read_file", "run_verifier", "finish"])
def test_approval_for_a_kind_that_is_not_a_write_is_refused_by_name(kind: str) -> None:
    """An approval gates one effect; a scenario that asks it of a read would load and
    never be enforced, so it is refused at load, naming the field."""
    with pytest.raises(ScenarioError, match="not a write") as err:
        load_scenario(dump(scenario_data(approval_required=["write_file", kind])))
    assert err.value.field == "approval_required"


def test_non_object_and_malformed_text_are_typed_errors() -> None:
    with pytest.raises(ScenarioError):
        load_scenario("[1, 2]")
    with pytest.raises(ScenarioError):
        load_scenario("{not json")
    with pytest.raises(ScenarioError):
        load_scenario("when: 2024-01-01\n", fmt="yaml")


def test_folders_in_allowed_paths_cover_their_contents_only() -> None:
    scenario = Scenario.model_validate(scenario_data())
    assert scenario.path_allowed("docs/guide.md")
    assert scenario.path_allowed("app.py")
    assert not scenario.path_allowed("docs2/guide.md")
    assert not scenario.path_allowed("app.py.bak")
