"""docker-compose.yml parses, keeps Redis durable, and runs only commands the CLI has."""

from __future__ import annotations

from pathlib import Path

import typer.main
import yaml

from ratchet.cli import app

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_redis_keeps_every_acknowledged_write_on_disk() -> None:
    command = compose()["services"]["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"


def test_the_worker_service_scales_and_carries_no_key_in_its_environment() -> None:
    services = compose()["services"]
    worker = services["worker"]
    assert "container_name" not in worker  # a fixed name would forbid --scale
    assert worker["command"][:2] == ["ratchet", "worker"]
    for service in services.values():
        for name, value in (service.get("environment") or {}).items():
            assert "KEY=" not in f"{name}={value}" or name.endswith("_FILE"), name
            assert name != "RATCHET_CHECKPOINT_KEY"


def test_every_command_in_the_compose_file_exists_in_the_cli() -> None:
    root = typer.main.get_command(app)
    assert hasattr(root, "commands")  # a group
    for name, service in compose()["services"].items():
        command = service.get("command")
        if not command or command[0] != "ratchet":
            continue
        group = root
        args = list(command[1:])
        while hasattr(group, "commands") and args and args[0] in group.commands:
            group = group.commands[args.pop(0)]
        assert not hasattr(group, "commands"), f"{name}: {command} names no command"
        known = {opt for param in group.params for opt in getattr(param, "opts", [])}
        for arg in args:
            if arg.startswith("--"):
                assert arg in known, f"{name}: {arg} is not an option of {command[:2]}"


def ratchet_commands() -> list[tuple[str, list[str]]]:
    """Every ratchet command line in the file: services' commands and healthchecks."""
    out = []
    for name, service in compose()["services"].items():
        command = service.get("command")
        if command and command[0] == "ratchet":
            out.append((name, list(command)))
        test = (service.get("healthcheck") or {}).get("test") or []
        if test[:2] == ["CMD", "ratchet"]:
            out.append((f"{name} healthcheck", list(test[1:])))
    return out


def test_every_healthcheck_command_exists_in_the_cli_too() -> None:
    root = typer.main.get_command(app)
    checks = [(name, cmd) for name, cmd in ratchet_commands() if name.endswith("healthcheck")]
    assert [name for name, _ in checks] == ["worker healthcheck"]
    for name, command in checks:
        group = root
        args = list(command[1:])
        while hasattr(group, "commands") and args and args[0] in group.commands:
            group = group.commands[args.pop(0)]
        assert not hasattr(group, "commands"), f"{name}: {command} names no command"
        known = {opt for param in group.params for opt in getattr(param, "opts", [])}
        assert all(arg in known for arg in args if arg.startswith("--")), name


def test_long_running_services_restart_and_one_shot_services_do_not() -> None:
    services = compose()["services"]
    for name in ("redis", "worker"):
        assert services[name].get("restart") in {"unless-stopped", "always", "on-failure"}, name
    for name in ("store-init", "submit-example"):
        assert services[name].get("restart") == "no", name


def test_the_worker_healthcheck_expects_every_worker_process_of_the_container() -> None:
    worker = compose()["services"]["worker"]
    command, test = worker["command"], worker["healthcheck"]["test"]
    assert test[:3] == ["CMD", "ratchet", "health"]
    concurrency = command[command.index("--concurrency") + 1]
    assert test[test.index("--min-workers") + 1] == concurrency
    check = worker["healthcheck"]
    assert {"interval", "timeout", "retries", "start_period"} <= set(check)


def test_the_reviewers_file_is_mounted_and_configured_like_the_approvers_file() -> None:
    worker = compose()["services"]["worker"]
    env, volumes = worker["environment"], worker["volumes"]
    for role in ("approvers", "reviewers"):
        path = env[f"RATCHET_{role.upper()}_FILE"]
        assert f"./keys/{role}.json:{path}:ro" in volumes, role
