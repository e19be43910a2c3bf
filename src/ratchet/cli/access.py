"""``ratchet redis acl | load-scripts``: least-privilege Redis users (see
:mod:`ratchet.leasing.acl` and ``docs/redis.md``)."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Annotated, Any

import typer

from ratchet.cli.common import JsonFlag, app, print_json, ratchet_errors, write_private
from ratchet.errors import ConfigurationError
from ratchet.fleet.context import ensure_embedded_redis
from ratchet.fleet.redisurl import redis_client
from ratchet.fleet.settings import Settings
from ratchet.leasing import RedisStore
from ratchet.leasing.acl import AclUser, Role, acl_file, acl_setuser_lines
from ratchet.leasing.scripts import ScriptName

__all__: list[str] = []

redis_app = typer.Typer(
    help="Redis access: least-privilege ACL users, script loading.", no_args_is_help=True
)
app.add_typer(redis_app, name="redis")


@redis_app.command("acl")
@ratchet_errors
def redis_acl(
    out: Annotated[
        Path, typer.Option("--out", help="Folder for users.acl and the password files (created).")
    ],
    prefix: Annotated[str, typer.Option(help="User name prefix.")] = "ratchet",
    default_user: Annotated[
        str,
        typer.Option("--default-user", help="ping: the unauthenticated user may only PING; off."),
    ] = "ping",
    as_json: JsonFlag = False,
) -> None:
    """Write a Redis ACL file with one user per role and a fresh password per user.

    OUT/users.acl holds SHA-256 hashes only (point Redis' `aclfile` at it, or apply the
    printed ACL SETUSER lines as an admin); OUT/USER.password (mode 0600) holds each
    password, for that user's URL: redis://USER:PASSWORD@host:6379/0.
    """
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    users = []
    for role in Role:
        name = f"{prefix}-{role.value}"
        password = secrets.token_urlsafe(24)
        write_private(out / f"{name}.password", password.encode())
        users.append(AclUser.with_password(name, role, password))
    acl_path = out / "users.acl"
    if acl_path.exists():
        raise ConfigurationError(f"{acl_path} already exists; not overwriting", field="out")
    acl_path.write_text(acl_file(users, default_user=default_user))
    lines = acl_setuser_lines(users)
    info: dict[str, Any] = {
        "acl_file": str(acl_path),
        "users": [u.name for u in users],
        "setuser": lines,
    }
    if as_json:
        print_json(info)
        return
    typer.echo(f"wrote {acl_path} and one .password file per user (mode 0600)")
    for line in lines:
        typer.echo(line)


@redis_app.command("load-scripts")
@ratchet_errors
def redis_load_scripts(as_json: JsonFlag = False) -> None:
    """Load ratchet's Lua scripts into Redis (run as the admin user, after every Redis
    start: workers may only EVALSHA them)."""
    settings = Settings()
    if settings.redis_url is not None:
        url = settings.redis_url.get_secret_value()
    else:
        url = ensure_embedded_redis(settings.state_dir)
    RedisStore(redis_client(url)).load_scripts()
    names = [name.value for name in ScriptName]
    if as_json:
        print_json({"loaded": names})
    else:
        typer.echo(f"loaded {len(names)} scripts")
