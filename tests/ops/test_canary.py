"""Canary: recognisable keys are planted; none may surface in a log line, a metric, a
trace (checkpoint), a Redis value, command output or an error message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from prometheus_client import REGISTRY, generate_latest

from ratchet.demo.examples import make_greeting_workspace
from ratchet.leasing.encoding import ZSTD_MAGIC, decode_checkpoint
from ratchet.redis_server import RedisServer
from tests.conftest import test_sandbox_mode

pytestmark = [pytest.mark.slow, pytest.mark.sandbox]

RATCHET = [sys.executable, "-m", "ratchet.cli.entry"]
CHECKPOINT_CANARY = "5ec7e7c0ffee" * 5 + "5ec7"  # 32 bytes, easy to spot
APPROVER_SEED = bytes.fromhex("ca11ab1e" * 8)


def ratchet(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RATCHET, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def forms(secret: bytes) -> list[str]:
    """The shapes a leaked key could take in text."""
    import base64

    return [
        secret.hex(),
        secret.hex().upper(),
        base64.b64encode(secret).decode()[:24],
        repr(secret)[2:30],
    ]


def redis_values(server: RedisServer) -> bytes:
    client = redis.Redis(port=server.port)
    out = []
    for key in client.scan_iter(count=500):
        kind = client.type(key)
        if kind == b"string":
            value = client.get(key) or b""
            out.append(value)
            if value.startswith(ZSTD_MAGIC):  # a stored checkpoint: scan what it holds
                envelope = decode_checkpoint(value, max_bytes=1 << 24)
                assert envelope != value, "a stored frame did not decompress"
                out.append(envelope)
        elif kind == b"hash":
            out += [k + b"=" + v for k, v in client.hgetall(key).items()]
        elif kind == b"list":
            out += client.lrange(key, 0, -1)
        elif kind == b"set":
            out += list(client.smembers(key))
        elif kind == b"zset":
            out += client.zrange(key, 0, -1)
        elif kind == b"stream":
            out += [repr(e).encode() for e in client.xrange(key)]
    return b"\n".join(out)


def test_planted_keys_appear_in_no_log_metric_trace_store_value_output_or_error(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    approver = Ed25519PrivateKey.from_private_bytes(APPROVER_SEED)
    pem = approver.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    key_file = tmp_path / "approver-alice.pem"
    key_file.write_bytes(pem)
    key_file.chmod(0o600)
    trust = tmp_path / "approvers.json"
    trust.write_text(
        json.dumps(
            {"alice": approver.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()}
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_REDIS_URL=redis_server.url,
        RATCHET_CHECKPOINT_KEY=CHECKPOINT_CANARY,
        RATCHET_QUEUE=f"canary-{tmp_path.name}",
        RATCHET_LEASE_TTL_MS="1500",
        RATCHET_REAPER_INTERVAL_MS="200",
        RATCHET_APPROVERS_FILE=str(trust),
        RATCHET_LOG_FORMAT="json",
        RATCHET_LOG_LEVEL="DEBUG",
        # The verifier is the example's own test, not agent-written code: bubblewrap
        # where it works, else the explicit opt-out (a fresh machine has no bubblewrap).
        RATCHET_VERIFIER_SANDBOX=test_sandbox_mode().value,
    )
    root = make_greeting_workspace(tmp_path / "ws")
    task = {
        "scenario": {
            "schema_version": 1,
            "task_id": "fix-greeting",
            "task_version": "1",
            "policy_id": "default",
            "policy_version": "1",
            "permissions": ["read_file", "write_file", "run_verifier", "finish"],
            "allowed_paths": ["app.py"],
            "allowed_verifier_targets": ["unit"],
            "approval_required": ["write_file"],
            "budgets": {"proposals": 30, "steps": 20, "wall_clock_seconds": 3600, "cost_units": 0},
            "initial_files": {"app.py": (root / "app.py").read_text()},
            "verifier": {"target": "unit", "expected_files": {"app.py": 'print("Hello, world")\n'}},
        },
        "environment": {
            "root": "ws",
            "verifiers": {"unit": {"argv": [sys.executable, "test_app.py"]}},
        },
    }
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    outputs: list[str] = []

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        done = ratchet(*args, env={**env, **extra}, cwd=tmp_path)
        outputs.extend([done.stdout, done.stderr])
        return done

    run_id = run("submit", "task.yaml", "--agent", "greeting").stdout.strip()
    first = run("worker", "--burst")
    assert first.returncode == 0, first.stderr[-2000:]
    shown = json.loads(run("show", run_id, "--json").stdout)
    action_id = shown["pending"]["action"]["action_id"]
    # Errors on the way: a wrong action, a wrong checkpoint key, a malformed key file.
    assert run("approve", run_id, "no-such-action", "--key", str(key_file)).returncode == 2
    assert run("show", run_id, RATCHET_CHECKPOINT_KEY="ab" * 32).returncode == 2
    bad = tmp_path / "bad-keys.json"
    bad.write_text(json.dumps({"signing": "k1", "keys": {"k1": CHECKPOINT_CANARY[:-2] + "zz"}}))
    assert (
        run("runs", RATCHET_CHECKPOINT_KEY="", RATCHET_CHECKPOINT_KEYS_FILE=str(bad)).returncode
        == 2
    )
    assert run("approve", run_id, action_id, "--key", str(key_file)).returncode == 0
    second = run("worker", "--burst", RATCHET_LOG_FORMAT="text")
    assert second.returncode == 0, second.stderr[-2000:]
    final = run("show", run_id, "--json")
    assert json.loads(final.stdout)["phase"] == "completed"

    # The worker's JSON lines: parseable, and every line about a run names it fully.
    lines = [json.loads(line) for line in first.stderr.splitlines() if line.startswith("{")]
    about_runs = [line for line in lines if line.get("run_id")]
    assert about_runs, "the worker logged lines about the run"
    for line in about_runs:
        assert {"lease_version", "generation", "worker_id"} <= set(line), line
    assert "run_id=" + run_id in second.stderr  # text lines carry the same fields

    # In-process: metrics exposition of a process that ran jobs with these keys.
    from ratchet.fleet.context import Fleet
    from ratchet.fleet.settings import Settings

    fleet = Fleet.connect(
        Settings(
            redis_url=redis_server.url,
            queue="canary-in-process",
            checkpoint_key=CHECKPOINT_CANARY,
            approvers_file=trust,
        )
    )
    exposition = generate_latest(REGISTRY).decode()
    everything = "\n".join([*outputs, exposition, repr(fleet), repr(fleet.keyring)])
    stored = redis_values(redis_server)
    assert b'"outcome":"completed"' in stored or b"completed" in stored  # the trace is there
    secrets_ = forms(bytes.fromhex(CHECKPOINT_CANARY)) + forms(APPROVER_SEED)
    secrets_ += [line for line in pem.decode().splitlines() if "PRIVATE KEY" not in line]
    for secret in secrets_:
        assert secret not in everything, f"a planted key leaked: {secret[:8]}..."
        assert secret.encode() not in stored, f"a planted key is stored: {secret[:8]}..."
