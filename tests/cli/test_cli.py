"""The ``ratchet`` command line: demo, scenario check, keys, version, and error handling."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from ratchet.cli import app
from ratchet.cli import local as cli_local
from ratchet.cli.common import CHECKPOINT_KEY_ENV
from ratchet.demo.local import DemoReport
from tests.runtime.world import CHECKPOINT_SECRET, scenario_data

runner = CliRunner()
CANARY_ENV = {CHECKPOINT_KEY_ENV: CHECKPOINT_SECRET.hex()}


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return runner.invoke(app, list(args), env=env)


def write_json(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def valid_scenario(tmp_path: Path) -> Path:
    return write_json(tmp_path / "scenario.json", json.dumps(scenario_data()))


# --- demo ------------------------------------------------------------------------------------


def test_demo_recovers_the_crash_window_with_exactly_one_write_and_completes() -> None:
    result = invoke("demo", "--local", "--json", env=CANARY_ENV)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["write_count"] == 1
    assert report["phase"] == "completed"
    assert report["crash_window_recovered"] == "after_adapter_before_receipt"
    assert report["reconcile_outcome"] == "reconciled"
    assert report["lease_version"] == 2
    assert report["stale_write_refused"] is True
    assert "reconciled" in report["trace_outcomes"]
    assert report["trace_outcomes"][-1] == "completed"
    assert [e["seq"] for e in report["trace"]] == list(range(1, len(report["trace"]) + 1))


def test_demo_prints_a_trace_table_and_says_it_runs_on_in_memory_stand_ins() -> None:
    result = invoke("demo", "--local")
    assert result.exit_code == 0, result.output
    assert "in-memory stand-ins" in result.stdout
    assert "ratchet demo` without --local" in " ".join(result.stdout.split())
    assert "reconciled" in result.stdout
    assert "after_adapter_before_receipt" in result.stdout


def test_demo_exits_non_zero_when_one_of_its_checks_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken_demo(key: bytes | None = None) -> DemoReport:
        report = DemoReport(
            run_id="demo-run-1",
            phase="completed",
            generation=7,
            write_count=2,
            crash_window="after_adapter_before_receipt",
            recovered_window="after_adapter_before_receipt",
            reconcile_outcome="reconciled",
            lease_version=2,
            stale_write_refused=True,
            final_content="",
            trace=[],
        )
        report.checks = {"exactly one write": False}
        return report

    monkeypatch.setattr(cli_local, "run_demo", broken_demo)
    result = invoke("demo", "--local", "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["ok"] is False
    assert "exactly one write" in result.stderr


def test_a_bad_checkpoint_key_is_one_line_on_stderr_with_exit_2_and_no_traceback() -> None:
    result = invoke("demo", "--local", env={CHECKPOINT_KEY_ENV: "00ff" * 4})
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "at least 32 bytes" in result.stderr
    assert "Traceback" not in result.output
    assert "00ff00ff" not in result.output


# --- scenario check --------------------------------------------------------------------------


def test_scenario_check_accepts_a_valid_file_and_prints_its_fingerprint(
    valid_scenario: Path,
) -> None:
    result = invoke("scenario", "check", str(valid_scenario), "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["ok"] is True
    assert len(info["fingerprint"]) == 64
    human = invoke("scenario", "check", str(valid_scenario))
    assert human.exit_code == 0
    assert info["fingerprint"] in human.stdout


def test_scenario_check_reads_yaml_with_the_same_fingerprint(
    tmp_path: Path,
    valid_scenario: Path,
) -> None:
    as_yaml = tmp_path / "scenario.yaml"
    as_yaml.write_text(yaml.safe_dump(scenario_data()), encoding="utf-8")
    from_json = json.loads(invoke("scenario", "check", str(valid_scenario), "--json").stdout)
    result = invoke("scenario", "check", str(as_yaml), "--format", "yaml", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["fingerprint"] == from_json["fingerprint"]


def test_scenario_check_rejects_a_duplicate_key_naming_the_field(tmp_path: Path) -> None:
    text = json.dumps(scenario_data())
    path = write_json(tmp_path / "dup.json", text[:-1] + ', "task_version": "2"}')
    result = invoke("scenario", "check", str(path))
    assert result.exit_code == 2
    assert "duplicate key" in result.stderr
    assert "task_version" in result.stderr
    assert "Traceback" not in result.output


def test_scenario_check_rejects_an_unknown_field_naming_it(tmp_path: Path) -> None:
    path = write_json(tmp_path / "unknown.json", json.dumps(scenario_data(colour="blue")))
    result = invoke("scenario", "check", str(path), "--json")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "colour" in result.stderr


def test_scenario_check_of_a_missing_file_exits_2(tmp_path: Path) -> None:
    result = invoke("scenario", "check", str(tmp_path / "absent.json"))
    assert result.exit_code == 2
    assert "cannot read" in result.stderr


# --- keys ------------------------------------------------------------------------------------


def test_gen_checkpoint_key_prints_32_random_bytes_as_hex_and_a_note_on_stderr() -> None:
    first, second = invoke("keys", "gen-checkpoint-key"), invoke("keys", "gen-checkpoint-key")
    assert first.exit_code == 0
    key = first.stdout.strip()
    assert len(bytes.fromhex(key)) == 32
    assert key != second.stdout.strip()
    assert "outside" in first.stderr


def test_gen_signer_writes_a_0600_private_key_and_prints_only_the_public_key(
    tmp_path: Path,
) -> None:
    result = invoke(
        "keys",
        "gen-signer",
        "--role",
        "reviewer",
        "--id",
        "rita",
        "--out",
        str(tmp_path / "keys"),
        "--json",
    )
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    path = Path(info["private_key_path"])
    assert path == tmp_path / "keys" / "reviewer-rita.pem"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    pem = path.read_bytes()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")
    assert len(bytes.fromhex(info["public_key_hex"])) == 32
    body = b"".join(pem.splitlines()[1:-1]).decode()
    assert body not in result.output
    assert "PRIVATE KEY" not in result.output


def test_gen_signer_never_overwrites_an_existing_key(tmp_path: Path) -> None:
    args = ("keys", "gen-signer", "--role", "approver", "--id", "alice", "--out", str(tmp_path))
    assert invoke(*args).exit_code == 0
    before = (tmp_path / "approver-alice.pem").read_bytes()
    again = invoke(*args)
    assert again.exit_code == 2
    assert "already exists" in again.stderr
    assert (tmp_path / "approver-alice.pem").read_bytes() == before


def test_gen_signer_refuses_a_signer_id_that_could_leave_the_folder(tmp_path: Path) -> None:
    result = invoke(
        "keys",
        "gen-signer",
        "--role",
        "approver",
        "--id",
        "../evil",
        "--out",
        str(tmp_path / "keys"),
    )
    assert result.exit_code == 2
    assert "field: id" in result.stderr
    assert not (tmp_path / "evil.pem").exists()


# --- version, secrets, entry point -------------------------------------------------------------


def test_version_prints_the_package_version() -> None:
    result = invoke("version", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["name"] == "ratchet"
    assert invoke("version").stdout.startswith("ratchet ")


def test_no_command_output_contains_the_checkpoint_key(
    tmp_path: Path,
    valid_scenario: Path,
) -> None:
    runs = [
        invoke("demo", "--local", env=CANARY_ENV),
        invoke("demo", "--local", "--json", env=CANARY_ENV),
        invoke("scenario", "check", str(valid_scenario), env=CANARY_ENV),
        invoke(
            "keys",
            "gen-signer",
            "--role",
            "approver",
            "--id",
            "carol",
            "--out",
            str(tmp_path / "keys"),
            env=CANARY_ENV,
        ),
        invoke("version", "--json", env=CANARY_ENV),
    ]
    secret_text = CHECKPOINT_SECRET.decode("ascii")
    for result in runs:
        assert result.exit_code == 0, result.output
        for stream in (result.stdout, result.stderr):
            assert "CANARY" not in stream
            assert secret_text not in stream
            assert CHECKPOINT_SECRET.hex() not in stream


def test_the_installed_entry_point_runs() -> None:
    script = Path(sys.executable).with_name("ratchet")
    if not script.exists():
        pytest.skip("the ratchet console script is not installed next to this interpreter")
    done = subprocess.run(
        [str(script), "version", "--json"], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["name"] == "ratchet"
