"""docker-compose.yml parses, keeps Redis durable, and runs only commands the CLI has; its
profile `replicated` (a primary, a replica, three Sentinels and a worker that waits for a
replica's confirmation) stays apart from the default topology."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import typer.main
import yaml

from ratchet.cli import app
from ratchet.fleet.redisurl import parse_sentinel_url

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
    assert [name for name, _ in checks] == [
        "worker healthcheck",
        "worker-replicated healthcheck",
    ]
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


# --- profile `replicated` ---------------------------------------------------------------

PROFILE = "replicated"
DEFAULT_SERVICES = {"redis", "store-init", "worker"}
SENTINEL_PORT = 26379
MONITOR = re.compile(r"^sentinel monitor (\S+) (\S+) (\d+) (\d+)$")


def profile_services(profile: str = PROFILE) -> dict[str, dict]:  # type: ignore[type-arg]
    return {
        name: service
        for name, service in compose()["services"].items()
        if profile in (service.get("profiles") or [])
    }


def sentinel_services() -> dict[str, dict]:  # type: ignore[type-arg]
    return {
        name: service
        for name, service in profile_services().items()
        if "--sentinel" in " ".join(service.get("command") or [])
    }


def server_args(service: dict) -> list[str]:  # type: ignore[type-arg]
    command = list(service["command"])
    assert command[0] == "redis-server", command
    return command[1:]


def option(args: list[str], name: str) -> list[str]:
    """The values after ``--name`` up to the next option."""
    start = args.index(name) + 1
    end = start
    while end < len(args) and not args[end].startswith("--"):
        end += 1
    return args[start:end]


def sentinel_config(name: str, service: dict) -> list[str]:  # type: ignore[type-arg]
    """The lines of the Sentinel's configuration its start-up script writes, with the
    service's environment filled in as the shell would (compose turns ``$$`` into ``$``)."""
    shell, flag, script = service["command"]
    assert (shell, flag) == ("sh", "-c"), name
    writer, _, rest = script.partition("> ")
    target = rest.split()[0]
    assert writer.lstrip().startswith(f"[ -f {target} ] ||"), (name, "write it only once")
    words = shlex.split(writer.partition("||")[2].replace("\\\n", " "))
    assert words[:2] == ["printf", "%s\\n"], name
    lines = words[2:]
    for variable, value in (service.get("environment") or {}).items():
        lines = [line.replace(f"$${variable}", str(value)) for line in lines]
    assert not any("$" in line for line in lines), (name, lines)
    assert f"redis-server {target} --sentinel" in rest, (name, "runs the file it wrote")
    return lines


def test_the_replicated_profile_has_its_services_and_they_are_in_no_other_profile() -> None:
    services = compose()["services"]
    replicated = profile_services()
    assert set(replicated) == {
        "redis-primary",
        "redis-replica",
        "sentinel-1",
        "sentinel-2",
        "sentinel-3",
        "store-init-replicated",
        "worker-replicated",
    }
    for name, service in replicated.items():
        assert service["profiles"] == [PROFILE], name
    # The default topology (no profile) is what it was, and neither side needs the other:
    # a dependency on a default service would start it with the profile, and back.
    default = {name for name, service in services.items() if not service.get("profiles")}
    assert default == DEFAULT_SERVICES
    for name, service in services.items():
        inside = name in replicated
        for dependency in service.get("depends_on") or {}:
            assert (dependency in replicated) == inside, (name, dependency)


def test_every_named_volume_a_service_uses_is_declared_and_each_server_has_its_own() -> None:
    data = compose()
    declared = set(data["volumes"])
    owners: dict[str, str] = {}
    for name, service in data["services"].items():
        for volume in service.get("volumes") or []:
            source = volume.split(":", 1)[0]
            if source.startswith((".", "/")):
                continue  # a bind mount
            assert source in declared, (name, source)
            if service.get("image", "").startswith("redis"):
                assert owners.setdefault(source, name) == name, (source, name)
    assert {"redis-primary-data", "redis-replica-data"} <= set(owners)


def test_the_replicated_worker_names_exactly_the_three_sentinels_and_the_service() -> None:
    sentinels = sentinel_services()
    assert sorted(sentinels) == ["sentinel-1", "sentinel-2", "sentinel-3"]
    for name in ("worker-replicated", "store-init-replicated"):
        url = profile_services()[name]["environment"]["RATCHET_REDIS_URL"]
        assert urlsplit(url).scheme == "redis+sentinel"
        target = parse_sentinel_url(url)
        assert sorted(target.sentinels) == [(s, SENTINEL_PORT) for s in sorted(sentinels)]
        assert target.service == "ratchet"
        assert (target.db, target.username, target.password) == (0, None, None), name
    # Every Sentinel listens where the URL says and watches that same service.
    for name, service in sentinels.items():
        lines = sentinel_config(name, service)
        assert f"port {SENTINEL_PORT}" in lines, name
        (monitor,) = [m for m in map(MONITOR.match, lines) if m]
        assert monitor.group(1) == "ratchet", name


def test_the_sentinels_quorum_is_a_majority_and_they_watch_the_primary_by_name() -> None:
    sentinels = sentinel_services()
    primary_port = "6379"  # the primary does not move off Redis' default port
    assert "--port" not in server_args(profile_services()["redis-primary"])
    for name, service in sentinels.items():
        lines = sentinel_config(name, service)
        (index,) = [i for i, line in enumerate(lines) if MONITOR.match(line)]
        match = MONITOR.match(lines[index])
        assert match is not None
        service_name, host, port, quorum = match.groups()
        assert (service_name, host, port) == ("ratchet", "redis-primary", primary_port), name
        assert len(sentinels) // 2 < int(quorum) <= len(sentinels), (name, quorum)
        # A host name is accepted only when resolving names is switched on before the
        # monitor line; each Sentinel announces its own service name.
        assert "sentinel resolve-hostnames yes" in lines[:index], name
        assert f"sentinel announce-ip {name}" in lines, name
        assert not any(line.startswith("sentinel auth-pass") for line in lines), name
        # Sentinel rewrites its file: it is written at start into a volume of its own,
        # never mounted read-only.
        volumes = service.get("volumes") or []
        assert volumes == [f"{name}-data:/data"], name
        assert service.get("restart") == "unless-stopped", name
    # The three configurations differ only in the name each Sentinel announces.
    texts = {"\n".join(sentinel_config(n, s)).replace(n, "<name>") for n, s in sentinels.items()}
    assert len(texts) == 1


def test_the_primary_and_the_replica_keep_every_acknowledged_write_and_never_evict() -> None:
    replicated = profile_services()
    for name in ("redis-primary", "redis-replica"):  # the replica may be promoted
        args = server_args(replicated[name])
        assert option(args, "--appendonly") == ["yes"], name
        assert option(args, "--appendfsync") == ["always"], name
        assert option(args, "--maxmemory-policy") == ["noeviction"], name
        assert option(args, "--replica-announce-ip") == [name], name
        assert replicated[name].get("restart") == "unless-stopped", name
    assert "--replicaof" not in server_args(replicated["redis-primary"])
    # The replica follows the primary, by its service name and port.
    assert option(server_args(replicated["redis-replica"]), "--replicaof") == [
        "redis-primary",
        "6379",
    ]
    assert "redis-primary" in replicated["redis-replica"]["depends_on"]


def test_the_replicated_worker_waits_for_a_replica_it_has() -> None:
    replicated = profile_services()
    replicas = [
        name
        for name, service in replicated.items()
        if service.get("command", [""])[0] == "redis-server"
        and "--replicaof" in server_args(service)
    ]
    for name in ("worker-replicated", "store-init-replicated"):
        ack = int(replicated[name]["environment"]["RATCHET_MIN_REPLICAS_ACK"])
        assert 1 <= ack <= len(replicas), (name, ack, replicas)
        depends = replicated[name]["depends_on"]
        assert {"sentinel-1", "sentinel-2", "sentinel-3"} <= set(depends), name
    assert replicated["store-init-replicated"]["depends_on"]["redis-replica"] == {
        "condition": "service_healthy"
    }
    assert replicated["worker-replicated"]["depends_on"]["store-init-replicated"] == {
        "condition": "service_completed_successfully"
    }


def test_the_replicated_worker_is_the_default_worker_but_for_its_store() -> None:
    services = compose()["services"]
    worker, twin = services["worker"], services["worker-replicated"]
    for key in ("build", "command", "secrets", "healthcheck", "restart", "stop_signal"):
        assert twin[key] == worker[key], key
    store = {"RATCHET_REDIS_URL", "RATCHET_MIN_REPLICAS_ACK"}
    assert {k: v for k, v in twin["environment"].items() if k not in store} == {
        k: v for k, v in worker["environment"].items() if k not in store
    }
    assert "RATCHET_MIN_REPLICAS_ACK" not in worker["environment"]
    assert worker["environment"]["RATCHET_REDIS_URL"] == "redis://redis:6379/0"
    assert "container_name" not in twin  # it scales too
    binds = [v for v in twin["volumes"] if v.startswith("./")]
    assert binds == [v for v in worker["volumes"] if v.startswith("./")]
