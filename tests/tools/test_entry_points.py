"""Tools installed as packages: the ``ratchet.tools`` entry-point group, loaded by name
only when a run's scenario permits the tool, into the run's environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from ratchet.adapters import RouterAdapter
from ratchet.errors import AdapterError, ConfigurationError
from ratchet.fleet.runbuild import build_adapter, run_toolbox
from ratchet.fleet.runs import EnvironmentSpec, RunDocument, VerifierSpec
from ratchet.tools import Toolbox, load_entry_point_tool
from tests.adapters.harness import make_workspace, scenario


def document(root: Path, permissions: list[str]) -> RunDocument:
    return RunDocument(
        scenario=scenario(permissions=permissions),
        agent="greeting",
        environment=EnvironmentSpec(
            root=str(root), git=False, verifiers={"unit": VerifierSpec(argv=("true",))}
        ),
    )


def test_an_installed_tool_loads_by_its_entry_point_name(installed: Path) -> None:
    made = load_entry_point_tool("create_refund")
    assert made.spec.name == "create_refund" and made.spec.recovery.value == "idempotent"


def test_a_worker_loads_only_the_tools_the_scenario_permits(
    installed: Path, tmp_path: Path
) -> None:
    root = make_workspace(tmp_path / "ws")
    box = run_toolbox(document(root, ["read_file", "write_file", "finish", "create_refund"]))
    assert [t.spec.name for t in box] == ["create_refund"]
    adapter = build_adapter(document(root, ["finish", "create_refund"]), toolbox=box)
    assert isinstance(adapter, RouterAdapter) and adapter.tools is not None
    assert (root / ".ratchet" / "tools.ledger").exists()
    observed = adapter.observe().details
    assert observed["tools.fingerprint"] == adapter.tools.observe().fingerprint
    assert adapter.tools.contract_digest == box.catalog.digest_for(t.spec.name for t in box)


def test_a_run_without_declared_tools_keeps_the_plain_workspace(tmp_path: Path) -> None:
    root = make_workspace(tmp_path / "ws")
    adapter = build_adapter(document(root, ["read_file", "write_file", "finish"]))
    assert type(adapter).__name__ == "WorkspaceAdapter"
    assert not (root / ".ratchet" / "tools.ledger").exists()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("not_installed", "no tool 'not_installed' is installed"),
        ("misnamed", "provides a tool named 'order_status'"),
        ("broken", "failed to load (RuntimeError)"),
    ],
)
def test_a_tool_that_cannot_be_loaded_is_refused_in_one_line(
    installed: Path, name: str, message: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_entry_point_tool(name)
    assert message in str(caught.value)
    assert "secret-token" not in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("name", ["server_down", "server_died", "adapter_says"])
def test_a_tool_whose_server_is_down_is_a_retryable_failure_not_configuration(
    installed: Path, name: str
) -> None:
    """Transient is not configuration: the job is retried later, the run not frozen."""
    with pytest.raises(AdapterError) as caught:
        load_entry_point_tool(name)
    assert not isinstance(caught.value, ConfigurationError)
    assert caught.value.retryable is True
    assert "secret-token" not in str(caught.value) and "\n" not in str(caught.value)


def test_a_tool_package_that_cannot_be_imported_is_configuration(installed: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"failed to load \(ModuleNotFoundError\)"):
        load_entry_point_tool("not_importable")


def test_a_scenario_naming_a_missing_tool_is_refused_before_anything_is_built(
    installed: Path, tmp_path: Path
) -> None:
    root = make_workspace(tmp_path / "ws")
    with pytest.raises(ConfigurationError, match="not_installed"):
        build_adapter(document(root, ["finish", "not_installed"]))
    assert not (root / ".ratchet" / "tools.ledger").exists()


def test_a_toolbox_refuses_two_tools_with_one_name_and_builtin_names(installed: Path) -> None:
    made = load_entry_point_tool("create_refund")
    with pytest.raises(ConfigurationError, match="registered already"):
        Toolbox([made, load_entry_point_tool("create_refund")])
    from ratchet import tool

    with pytest.raises(ConfigurationError, match="built-in"):

        @tool(name="write_file")
        def write_file(path: str) -> None: ...
