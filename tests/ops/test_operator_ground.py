"""Operator commands execute nothing from a workspace, and read a signer's key last.

`ratchet review --decision rebaseline` observes the workspace on the operator's host. A
program planted in the repository's configuration (by code the agent wrote) used to run
there, as the operator, find the key's path on its parent's command line and copy the
reviewer's private key. Now the repository is read as data (nothing it configures runs,
no `git` at all), and the key is opened only after the observation is over: a key file
that would block (a FIFO) is never even opened when the observation fails, and is
refused, not waited on, when it succeeds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from ratchet.fleet.context import Fleet
from ratchet.ops import inspect_run, submit
from ratchet.redis_server import RedisServer
from ratchet.worker.job import execute_run
from tests.adapters.harness import run_git
from tests.ops.helpers import MakeWorkspace, trust_file, with_trust
from tests.planted import plant, ran
from tests.worker.conftest import CHECKPOINT_KEY_HEX

pytestmark = pytest.mark.sandbox

RITA = Ed25519PrivateKey.generate()


@pytest.fixture
def trusted(fleet: Fleet, tmp_path: Path) -> Fleet:
    return with_trust(fleet, reviewers_file=trust_file(tmp_path / "reviewers.json", {"rita": RITA}))


def frozen_git_run(trusted: Fleet, workspace: MakeWorkspace, run_id: str) -> Path:
    """A run on a git workspace, waiting for an approval, frozen because a person edited
    its file meanwhile: a rebaseline is what it needs."""
    root, document = workspace(approval_required=("write_file",))
    run_git(root, "init", "-q")
    run_git(root, "add", "-A")
    run_git(root, "commit", "-q", "-m", "initial")
    submit(trusted, document, run_id=run_id)
    assert execute_run(trusted, run_id, owner="w").phase == "awaiting_approval"
    assert "git_head" in inspect_run(trusted, run_id).state.environment.details
    (root / "app.py").write_text((root / "app.py").read_text() + "# edited by a person\n")
    assert execute_run(trusted, run_id, owner="w").outcome == "restore_refused"
    return root


def review_cli(
    trusted: Fleet, redis_server: RedisServer, cwd: Path, run_id: str, key: Path, path: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        PATH=path,
        RATCHET_REDIS_URL=redis_server.url,
        RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX,
        RATCHET_QUEUE=trusted.settings.queue,
        RATCHET_LOG_LEVEL="WARNING",
        RATCHET_REVIEWERS_FILE=str(trusted.settings.reviewers_file),
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ratchet.cli.entry",
            "review",
            run_id,
            "--decision",
            "rebaseline",
            "--key",
            str(key),
            "--id",
            "rita",
            "--json",
        ],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,  # a blocked open of the key would end the test here, failed
        check=False,
    )


def pem(path: Path) -> Path:
    path.write_bytes(RITA.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    path.chmod(0o600)
    return path


def test_a_rebaseline_on_a_planted_repository_runs_nothing_it_configures(
    trusted: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path
) -> None:
    root = frozen_git_run(trusted, workspace, "r-planted")
    markers = tmp_path / "markers"
    plant(root, markers)
    fake = tmp_path / "fake-bin"
    fake.mkdir()
    (fake / "git").write_text(f"#!/bin/sh\necho ran >> {markers}/git-binary\nexit 1\n")
    (fake / "git").chmod(0o755)
    done = review_cli(
        trusted,
        redis_server,
        tmp_path,
        "r-planted",
        pem(tmp_path / "reviewer-rita.pem"),
        f"{fake}{os.pathsep}{os.environ['PATH']}",
    )
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["verified"] is True and info["new_env_version"] > info["old_env_version"]
    assert ran(markers) == []


def test_the_key_is_opened_only_after_the_observation_and_never_waited_on(
    trusted: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path
) -> None:
    root = frozen_git_run(trusted, workspace, "r-fifo-key")
    key = tmp_path / "reviewer-rita.pem"
    os.mkfifo(key)  # opening it for reading would block until a writer came
    app = root / "app.py"
    saved = app.read_bytes()
    app.unlink()
    os.mkfifo(app)  # the observation refuses this before any key is read
    path = os.environ["PATH"]
    failed = review_cli(trusted, redis_server, tmp_path, "r-fifo-key", key, path)
    assert failed.returncode == 2, failed.stderr
    assert "app.py" in failed.stderr and "fifo" in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1
    app.unlink()
    app.write_bytes(saved)
    refused = review_cli(trusted, redis_server, tmp_path, "r-fifo-key", key, path)
    assert refused.returncode == 2 and "not a regular file" in refused.stderr, refused.stderr
