"""The public surface, the script headers, and the decoder's refusal to guess."""

from __future__ import annotations

import ast
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

import ratchet.leasing
from ratchet.errors import RunNotFoundError, StoreProtocolError
from ratchet.leasing import Lease
from ratchet.leasing.keyspace import check_id
from ratchet.leasing.replies import (
    decode_acquire,
    decode_commit,
    decode_counted,
    decode_create,
    decode_read,
    decode_release,
    decode_renew,
)
from ratchet.leasing.scripts import ScriptName

LEASE = Lease(run_id="r-1", owner="w1", lease_version=1, expires_at_ms=10, now_ms=5)


def test_the_public_names_of_ratchet_leasing_are_pinned() -> None:
    assert sorted(ratchet.leasing.__all__) == sorted(
        [
            "DEFAULT_MAX_CHECKPOINT_BYTES",
            "EXPIRY_INDEX",
            "RUNS_INDEX",
            "Acquired",
            "CommitResult",
            "Lease",
            "LeaseHolder",
            "LeasedRun",
            "PreparedCommit",
            "ReapClaim",
            "RedisStore",
            "Released",
            "RunCreated",
            "RunCreator",
            "RunKeys",
            "RunSnapshot",
            "new_commit_id",
            "nonce_key",
            "run_keys",
        ]
    )
    for name in ratchet.leasing.__all__:
        assert hasattr(ratchet.leasing, name)


def test_the_leasing_library_code_has_no_assert_statements() -> None:
    package = Path(ratchet.leasing.__file__).parent
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        asserts = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
        assert not asserts, f"{path.name} uses assert at lines {asserts}"


@pytest.mark.parametrize("name", list(ScriptName))
def test_every_script_header_names_each_key_and_argument_it_uses(name: ScriptName) -> None:
    text = resources.files("ratchet.leasing").joinpath("lua", f"{name.value}.lua").read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("--"))
    body = "\n".join(line for line in text.splitlines() if not line.startswith("--"))
    for kind in ("KEYS", "ARGV"):
        used = set(re.findall(rf"{kind}\[(\d+)\]", body))
        named = set(re.findall(rf"^-- {kind}\[(\d+)\]", header, flags=re.M))
        named |= set(re.findall(rf"^-- {kind}\[(\d+)\.\.\]", header, flags=re.M))
        assert used <= named, f"{name.value}: {kind} used but not in the header"
    assert "Replies:" in header
    statuses = set(re.findall(r"\{'([a-z_]+)'", body))
    for status in statuses:
        assert f'"{status}"' in header, f"{name.value}: reply {status} not in the header"


MALFORMED: list[Any] = [
    None,
    b"committed",
    [],
    [5],
    [b"\xff\xfe"],
    [b"no_such_status"],
    [b"committed", 2],
    [b"committed", b"2", 2, 1, 1],
    [b"committed", True, 2, 1, 1],
    [b"committed", -2, 2, 1, 1],
    [b"lease_lost", b"w2", 2, 1],
]


@pytest.mark.parametrize("reply", MALFORMED)
def test_a_malformed_or_unknown_commit_reply_is_a_protocol_error(reply: Any) -> None:
    with pytest.raises(StoreProtocolError):
        decode_commit(reply, LEASE, commit_id="c-1", generation=2, expected_state_version=1)


def test_a_commit_reply_for_another_generation_is_a_protocol_error() -> None:
    with pytest.raises(StoreProtocolError):
        decode_commit(
            [b"committed", 3, 3, 10, 5],
            LEASE,
            commit_id="c-1",
            generation=2,
            expected_state_version=1,
        )


@pytest.mark.parametrize(
    "decode",
    [
        lambda r: decode_create(r, "r-1"),
        lambda r: decode_acquire(r, "r-1", "w1"),
        lambda r: decode_renew(r, LEASE),
        lambda r: decode_release(r, LEASE),
        lambda r: decode_read(r, "r-1", with_checkpoint=True, with_scenario=False),
    ],
)
@pytest.mark.parametrize("reply", [None, [], [b"bogus"], [b"no_run", 1], 42])
def test_every_decoder_refuses_to_guess(decode: Any, reply: Any) -> None:
    with pytest.raises(StoreProtocolError):
        decode(reply)


def test_a_checkpoint_that_arrives_as_text_is_a_protocol_error() -> None:
    reply = [b"run", b"t", b"e", 1, 1, 1, b"", 0, 0, 5, "decoded-text", 0, [], 0, 0]
    with pytest.raises(StoreProtocolError):
        decode_read(reply, "r-1", with_checkpoint=True, with_scenario=False)


def test_a_renewal_of_another_lease_version_is_a_protocol_error() -> None:
    with pytest.raises(StoreProtocolError):
        decode_renew([b"renewed", 2, 100, 5], LEASE)


@pytest.mark.parametrize("archive", [0, b"not a list", [b"ok", "text"], [b"ok", 7]])
def test_an_archive_that_is_not_a_list_of_bytes_is_a_protocol_error(archive: Any) -> None:
    reply = [b"run", b"t", b"e", 1, 1, 1, b"", 0, 0, 5, b"ckpt", 0, archive, 0, 0]
    with pytest.raises(StoreProtocolError):
        decode_read(reply, "r-1", with_checkpoint=True, with_scenario=False)


def test_an_unrequested_archive_is_a_protocol_error() -> None:
    reply = [b"run", b"t", b"e", 1, 1, 1, b"", 0, 0, 5, 0, 0, [b"seg"], 0, 0]
    with pytest.raises(StoreProtocolError):
        decode_read(reply, "r-1", with_checkpoint=False, with_scenario=False)


@pytest.mark.parametrize(
    ("tail", "archive_from", "keys"),
    [(0, 0, b"12345678"), (0, 3, 0), (2, 0, "text"), (2, "x", b"")],
)
def test_key_digests_or_a_tail_start_not_asked_for_or_malformed_are_protocol_errors(
    tail: int, archive_from: Any, keys: Any
) -> None:
    reply = [b"run", b"t", b"e", 1, 1, 1, b"", 0, 0, 5, b"ckpt", 0, [b"s"], archive_from, keys]
    with pytest.raises(StoreProtocolError):
        decode_read(reply, "r-1", with_checkpoint=True, with_scenario=False, tail=tail)


def test_more_segments_than_the_tail_asked_for_is_a_protocol_error() -> None:
    reply = [b"run", b"t", b"e", 1, 1, 1, b"", 0, 0, 5, b"ckpt", 0, [b"a", b"b", b"c"], 4, b""]
    with pytest.raises(StoreProtocolError):
        decode_read(reply, "r-1", with_checkpoint=True, with_scenario=False, tail=2)


@pytest.mark.parametrize(
    "reply",
    [None, [], [b"posted"], [b"posted", b"3"], [b"posted", 1, 2], [b"no_run", 1], [b"bogus", 1]],
)
def test_a_counted_reply_that_is_not_exactly_ok_and_one_integer_is_refused(reply: Any) -> None:
    with pytest.raises(StoreProtocolError):
        decode_counted(reply, "r-1", script="post_evidence", ok="posted")


def test_a_counted_reply_decodes_its_integer_or_names_the_missing_run() -> None:
    assert decode_counted([b"posted", 3], "r-1", script="post_evidence", ok="posted") == 3
    with pytest.raises(RunNotFoundError):
        decode_counted([b"no_run"], "r-1", script="post_evidence", ok="posted")


def test_commit_ids_are_unique_valid_and_a_forked_child_draws_its_own_prefix() -> None:
    ids = [ratchet.leasing.new_commit_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    for commit_id in ids[:3]:
        assert check_id(commit_id, "commit_id") == commit_id and "|" not in commit_id
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report one id and leave at once
        os.write(write, ratchet.leasing.new_commit_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 200).decode()
    os.close(read)
    os.close(write)
    assert child.rsplit("-", 1)[0] != ids[-1].rsplit("-", 1)[0]
