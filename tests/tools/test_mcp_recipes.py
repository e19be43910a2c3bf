"""Lookup recipes on their own (no server): what a write sends with its key written in,
what a lookup asks and what it concludes from the answer. The recipes against the real
reference servers are in test_reference_servers.py (in-process) and
tests/worker/test_mcp_recipe_fleet.py (worker processes SIGKILLed)."""

from __future__ import annotations

from typing import Any

import mcp_types
import pytest

from ratchet.errors import AdapterError, ConfigurationError
from ratchet.runtime.actions import derive_idempotency_key
from ratchet.tools import Found
from ratchet.tools.mcp import KeyRecipe
from ratchet.tools.mcp.recipes import git_trailer, sql_key_column

KEY = derive_idempotency_key("r-1", 0)
INTENT = "a" * 64
OTHER = "b" * 64
INSERT = "INSERT INTO notes (body, ratchet_key) VALUES ('hi', :ratchet_key)"


def answer(text: str, structured: Any = None) -> mcp_types.CallToolResult:
    return mcp_types.CallToolResult(
        content=[mcp_types.TextContent(type="text", text=text)], structured_content=structured
    )


def test_a_sql_write_gets_its_key_as_a_string_literal_where_the_placeholder_stood() -> None:
    recipe = sql_key_column("notes")
    sent = recipe.carried({"query": INSERT}, KEY, INTENT, "sql_write_query")
    assert sent == {"query": f"INSERT INTO notes (body, ratchet_key) VALUES ('hi', '{KEY}')"}
    assert recipe.missing({"query": INSERT}) is None


def test_a_sql_write_without_the_placeholder_is_refused_before_anything_is_sent() -> None:
    recipe = sql_key_column("notes")
    plain = {"query": "INSERT INTO notes (body) VALUES ('hi')"}
    assert recipe.missing(plain) == (
        "'query' must hold :ratchet_key where ratchet writes the call's key"
    )
    with pytest.raises(AdapterError) as refused:
        recipe.carried(plain, KEY, INTENT, "sql_write_query")
    assert refused.value.retryable is False
    assert "nothing was sent" in refused.value.message and "\n" not in refused.value.message


@pytest.mark.parametrize("bad", ["ik-1'); DROP TABLE notes; --", "ik 1", "ik-1\n", "", "x" * 201])
def test_a_key_outside_the_key_alphabet_is_refused_not_escaped(bad: str) -> None:
    recipe = sql_key_column("notes")
    with pytest.raises(AdapterError, match="key alphabet") as refused:
        recipe.carried({"query": INSERT}, bad, INTENT, "sql_write_query")
    assert refused.value.retryable is False
    with pytest.raises(AdapterError, match="key alphabet"):
        recipe.lookup_arguments(bad, "sql_write_query")


def test_the_sql_lookup_selects_the_row_by_its_quoted_key() -> None:
    recipe = sql_key_column("notes", "ratchet_key")
    assert recipe.lookup_arguments(KEY, "t") == {
        "query": f"SELECT ratchet_key FROM notes WHERE ratchet_key = '{KEY}'"
    }
    with_intent = sql_key_column("notes", intent_column="ratchet_intent")
    assert with_intent.lookup_arguments(KEY, "t") == {
        "query": f"SELECT ratchet_key, ratchet_intent FROM notes WHERE ratchet_key = '{KEY}'"
    }


@pytest.mark.parametrize("name", ["notes; DROP TABLE x", "no-tes", "1notes", '"notes"'])
def test_sql_names_that_are_not_plain_are_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match="plain SQL name"):
        sql_key_column(name)
    with pytest.raises(ConfigurationError, match="plain SQL name"):
        sql_key_column("notes", name)


def test_the_sql_lookup_reads_found_absent_and_cannot_say() -> None:
    recipe = sql_key_column("notes")
    row = answer(f"[{{'ratchet_key': '{KEY}'}}]")
    assert recipe.found(row, KEY, INTENT, "t") == {"found_by": "read_query", "key": KEY}
    assert recipe.found(answer("[]"), KEY, INTENT, "t") is None
    # mcp-server-sqlite answers a failed query with ordinary text: never "no such call".
    with pytest.raises(AdapterError, match="neither shows the key") as unsure:
        recipe.found(answer("Database error: no such table: notes"), KEY, INTENT, "t")
    assert unsure.value.retryable is True
    # Another key that merely starts like this one is not this one.
    longer = answer(f"[{{'ratchet_key': '{KEY}x'}}]")
    with pytest.raises(AdapterError):
        recipe.found(longer, KEY, INTENT, "t")


def test_an_intent_recipe_writes_the_digest_and_names_the_intent_it_finds() -> None:
    recipe = sql_key_column("notes", intent_column="ratchet_intent")
    query = (
        "INSERT INTO notes (body, ratchet_key, ratchet_intent) "
        "VALUES ('hi', :ratchet_key, :ratchet_intent)"
    )
    sent = recipe.carried({"query": query}, KEY, INTENT, "t")
    assert sent["query"].endswith(f"VALUES ('hi', '{KEY}', '{INTENT}')")
    assert recipe.missing({"query": INSERT}) is not None  # the intent placeholder is required
    mine = answer(f"[{{'ratchet_key': '{KEY}', 'ratchet_intent': '{INTENT}'}}]")
    assert recipe.found(mine, KEY, INTENT, "t") == Found(
        {"found_by": "read_query", "key": KEY}, INTENT
    )
    theirs = answer(f"[{{'ratchet_key': '{KEY}', 'ratchet_intent': '{OTHER}'}}]")
    found = recipe.found(theirs, KEY, INTENT, "t")
    assert isinstance(found, Found) and found.intent_digest == OTHER  # a review, not a pass
    both = answer(
        f"[{{'ratchet_key': '{KEY}', 'ratchet_intent': '{INTENT}'}}, "
        f"{{'ratchet_key': '{KEY}', 'ratchet_intent': '{OTHER}'}}]"
    )
    found = recipe.found(both, KEY, INTENT, "t")
    assert isinstance(found, Found) and found.intent_digest == OTHER
    with pytest.raises(AdapterError, match="several intents"):
        recipe.found(both, KEY, None, "t")


def test_the_git_trailer_recipe_appends_a_line_and_finds_it_in_the_log() -> None:
    recipe = git_trailer("/srv/repo", max_count=20)
    assert recipe.lookup_arguments(KEY, "t") == {"repo_path": "/srv/repo", "max_count": 20}
    sent = recipe.carried({"repo_path": "/srv/repo", "message": "Fix it"}, KEY, INTENT, "t")
    assert sent["message"] == f"Fix it\n\nRatchet-Key: {KEY}"
    log = answer(f"Commit history:\nCommit: 'abc'\nMessage: 'Fix it\n\n    Ratchet-Key: {KEY}\n'")
    assert recipe.found(log, KEY, INTENT, "t") == {"found_by": "git_log", "key": KEY}
    assert recipe.found(answer("Commit history:\n"), KEY, INTENT, "t") is None
    as_json = answer("", structured={"log": [f"Fix it\n\nRatchet-Key: {KEY}"]})
    assert recipe.found(as_json, KEY, INTENT, "t") is not None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"placeholder": ""}, "placeholder is empty"),
        ({"intent_placeholder": ":i"}, "needs a key placeholder"),
        ({"placeholder": ":k", "intent_placeholder": ":k2"}, "contain each other"),
        ({"quote": "shell"}, "quote"),
        ({"absent": "("}, "not a regular expression"),
    ],
)
def test_a_recipe_that_cannot_work_is_refused_when_declared(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        KeyRecipe(carry="query", tool="read_query", **fields)
