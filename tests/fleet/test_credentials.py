"""The worker's credential map: a name is defined by the worker, a URL is covered only by
its parsed scheme, host, port and path prefix (never by string prefix), and the secret is
read at use, handed out as a SecretStr and in no repr or error."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr, ValidationError

from ratchet.errors import ConfigurationError
from ratchet.fleet.credentials import CredentialMap, CredentialSpec, covers, parse_target
from ratchet.fleet.scrub import Scrubber
from ratchet.fleet.settings import Settings
from ratchet.worker.pool import _settings_json

DEST = "https://api.example.com/v1"
SECRET_ENV = "CREDENTIALS_TEST_SECRET"
CANARY = "sk-canary-credential-0123456789"


def one(destinations: tuple[str, ...] = (DEST,), **source: object) -> CredentialMap:
    spec = CredentialSpec.model_validate(
        {"destinations": destinations, **(source or {"env": SECRET_ENV})}
    )
    return CredentialMap({"openai": spec})


@pytest.mark.parametrize(
    "url",
    [
        "https://api.example.com/v1",
        "https://api.example.com/v1/",
        "https://api.example.com/v1/chat/completions",
        "https://api.example.com:443/v1/chat/completions",
        "HTTPS://API.Example.COM/v1/chat",  # scheme and host compare without case
        "https://api.example.com/v1?x=1",  # the query takes no part
    ],
)
def test_a_destination_covers_its_path_and_what_continues_it_after_a_slash(url: str) -> None:
    bound = one().bind("openai", url, field="f")
    assert bound.name == "openai"


@pytest.mark.parametrize(
    "url",
    [
        "https://api.example.com.evil.org/v1",  # another host that starts alike
        "https://api.example.com@evil.org/v1",  # user information: the host is evil.org
        "https://api.example.com:443@evil.org/v1",
        "https://user:pw@api.example.com/v1",  # user information, even on the right host
        "https://evil.org/api.example.com/v1",
        "https://evil.org/https://api.example.com/v1",
        "https://evil.org?https://api.example.com/v1",
        "https://evil.org#@api.example.com/v1",
        "https://evil.org\\@api.example.com/v1",  # a backslash: some clients read a slash
        "https://api.example.com\t.evil.org/v1",  # a tab some parsers silently drop
        "https://api.example.com%2eevil.org/v1",
        " https://api.example.com/v1",
        "https://api.example.com/v1\n",
        "https://api.exämple.com/v1",
        "http://api.example.com/v1",  # another scheme
        "https://api.example.com:8443/v1",  # another port
        "https://api.example.com/v10",  # a longer path segment, not a continuation
        "https://api.example.com/v",
        "https://api.example.com/",
        "https://api.example.com/v1/../admin",  # dot segments
        "https://api.example.com/v1/./../admin",
        "https://api.example.com/v1/%2e%2e/admin",  # ... and their encoded forms
        "https://api.example.com/v1%2f..%2fadmin",
        "https://api.example.com/v1/%5C..",
        "https://api.example.com:99999/v1",
        "ftp://api.example.com/v1",
        "api.example.com/v1",
        "",
    ],
)
def test_a_url_that_only_looks_like_the_destination_is_refused(url: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        one().bind("openai", url, field="agent_config.model.credential")
    assert refused.value.field == "agent_config.model.credential"
    assert "\n" not in refused.value.message


# URLs built from the pieces parsers disagree about: hosts that look like the
# destination's, and path characters that are separators, escapes or ignored somewhere.
_HOSTS = st.sampled_from(
    ["api.example.com", "API.Example.COM", "api.example.com:443", "api.example.com:"] * 3
    + [
        "api.example.com.",
        "api.example.com.evil.org",
        "evil.org",
        "api.example.com@evil.org",
        "evil.org@api.example.com",
        "api.example.com:443@evil.org",
        "[::1]",
        "",
    ]
)
# Harmless pieces come up more often, so that a fair share of the URLs is covered.
_SAFE = ["/v1", "/", "v1", "chat", "=", "~", ";", "?", ":", "/x"]
_TRICKY = [
    "v10", "/..", "/.", ".", "..", "%2e", "%2E", "%2f", "%40", "@", "#", "\\", "//",
    "evil.org", "%", "\t", "\n", " ", "é", "[", "]",
]  # fmt: skip
_PIECES = st.sampled_from(_SAFE * 4 + _TRICKY)


@settings(max_examples=1000, deadline=None)
@given(
    scheme=st.sampled_from(["https://", "HTTPS://"] * 3 + ["http://", "https:/", "https:"]),
    host=_HOSTS,
    start=st.sampled_from(["/v1", "/v1/", "", "/"]),
    pieces=st.lists(_PIECES, max_size=8),
)
def test_a_url_covered_is_read_the_same_by_the_client_that_sends_it(
    scheme: str, host: str, start: str, pieces: list[str]
) -> None:
    """Whatever the URL, when the map lets the credential go there, httpx (the client
    that sends it) reads the same scheme, host and port and a path under the prefix."""
    url = scheme + host + start + "".join(pieces)
    try:
        one().bind("openai", url, field="f")
    except ConfigurationError:
        event("refused")
        return
    event("covered")
    parsed = httpx.URL(url)
    assert (parsed.scheme, parsed.host, parsed.port or 443) == ("https", "api.example.com", 443)
    assert parsed.path == "/v1" or parsed.path.startswith("/v1/")


@settings(max_examples=300, deadline=None)
@given(
    host=st.from_regex(r"[a-z]{1,8}(\.[a-z]{1,8}){0,2}", fullmatch=True),
    other=st.from_regex(r"[a-z]{1,8}(\.[a-z]{1,8}){0,2}", fullmatch=True),
    path=st.from_regex(r"(/[a-z0-9]{1,4}){0,3}", fullmatch=True),
    rest=st.from_regex(r"(/[a-z0-9]{1,4}){0,2}", fullmatch=True),
)
def test_a_destination_covers_exactly_its_host_and_the_paths_under_it(
    host: str, other: str, path: str, rest: str
) -> None:
    destination = parse_target(f"https://{host}{path}")
    assert covers(destination, parse_target(f"https://{host}{path}{rest}"))
    assert covers(destination, parse_target(f"https://{host}:443{path}{rest}"))
    assert not covers(destination, parse_target(f"http://{host}{path}{rest}"))
    assert not covers(destination, parse_target(f"https://{host}:444{path}{rest}"))
    # A host that merely starts or ends with the destination's is another host.
    for elsewhere in (f"{host}.{other}", f"{other}.{host}", f"{host}{other}"):
        assert not covers(destination, parse_target(f"https://{elsewhere}{path}{rest}"))
    if path:
        assert not covers(destination, parse_target(f"https://{host}{path}x{rest}"))


@pytest.mark.parametrize("name", ["RATCHET_REDIS_URL", "ratchet_checkpoint_key", "nope"])
def test_a_ratchet_name_or_a_name_the_map_does_not_define_is_refused_in_one_line(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, CANARY)
    with pytest.raises(ConfigurationError) as refused:
        one().bind(name, DEST, field="environment.mcp.tickets.credential")
    message = refused.value.message
    assert refused.value.field == "environment.mcp.tickets.credential"
    assert "\n" not in message and CANARY not in message
    assert ("ratchet's own settings" in message) == name.upper().startswith("RATCHET_")


def test_a_value_that_is_not_a_name_is_not_echoed() -> None:
    with pytest.raises(ConfigurationError) as refused:
        one().bind("sk live key with spaces", DEST, field="f")
    assert "sk live" not in refused.value.message


def test_the_secret_is_read_from_the_variable_at_use_and_shown_nowhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    bound = one().bind("openai", DEST + "/chat", field="agent_config.model.credential")
    with pytest.raises(ConfigurationError) as unset:  # bound without it: a submit host
        bound()
    assert f"${SECRET_ENV}" in unset.value.message
    monkeypatch.setenv(SECRET_ENV, CANARY)
    secret = bound()
    assert isinstance(secret, SecretStr) and secret.get_secret_value() == CANARY
    monkeypatch.setenv(SECRET_ENV, CANARY + "-rotated")
    assert bound().get_secret_value() == CANARY + "-rotated"
    for shown in (repr(bound), str(bound), repr(secret), str(secret), repr(one())):
        assert CANARY not in shown
    assert "openai" in repr(bound) and "api.example.com" in repr(bound)


def test_the_secret_is_read_from_a_file_and_a_fifo_refuses_instead_of_hanging(
    tmp_path: Path,
) -> None:
    path = tmp_path / "openai.key"
    path.write_text(CANARY + "\n")
    assert one(file=str(path)).bind("openai", DEST, field="f")().get_secret_value() == CANARY
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigurationError) as refused:
        one(file=str(fifo)).bind("openai", DEST, field="f")()
    assert "file" in refused.value.message


@pytest.mark.parametrize("value", ["two words", "line\r\nX-Injected: 1", "é-not-ascii"])
def test_a_secret_that_is_not_one_visible_token_is_refused_without_echo(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, value)
    with pytest.raises(ConfigurationError) as refused:
        one().bind("openai", DEST, field="f")()
    assert value not in refused.value.message and "X-Injected" not in refused.value.message


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ({"env": "RATCHET_REDIS_URL", "destinations": [DEST]}, "RATCHET_"),
        ({"env": "ratchet_checkpoint_key", "destinations": [DEST]}, "RATCHET_"),
        ({"file": "relative/key", "destinations": [DEST]}, "absolute"),
        ({"env": "A", "file": "/k", "destinations": [DEST]}, "exactly one"),
        ({"destinations": [DEST]}, "exactly one"),
        ({"env": "A", "destinations": []}, "at least one destination"),
        ({"env": "A", "destinations": ["https://a@api.example.com/v1"]}, "user information"),
        ({"env": "A", "destinations": ["https://api.example.com/v1?x"]}, "query"),
        ({"env": "A", "destinations": ["api.example.com"]}, "http(s)"),
        ({"env": "A", "destinations": [DEST], "token": "x"}, "Extra"),
    ],
)
def test_a_bad_map_entry_is_refused_when_settings_load(spec: dict[str, object], why: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(credentials={"openai": spec})  # type: ignore[dict-item]
    assert why in str(refused.value)


@pytest.mark.parametrize("name", ["RATCHET_REDIS_URL", "1abc", "has space", "", "abc\n"])
def test_a_map_never_defines_a_ratchet_name_or_a_name_that_is_not_one(name: str) -> None:
    with pytest.raises(ValidationError):
        Settings(credentials={name: {"env": "A", "destinations": [DEST]}})  # type: ignore[dict-item]


def test_a_credential_is_never_read_from_a_key_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    with pytest.raises(ValidationError, match="key or trust file"):
        Settings(
            checkpoint_keys_file=keys,
            credentials={"openai": {"file": str(keys), "destinations": [DEST]}},  # type: ignore[dict-item]
        )


def test_the_map_is_read_from_ratchet_credentials_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "RATCHET_CREDENTIALS",
        '{"openai": {"env": "OPENAI_API_KEY", "destinations": ["https://api.openai.com/v1"]}}',
    )
    loaded = Settings().credentials
    assert loaded["openai"].env == "OPENAI_API_KEY"
    assert loaded["openai"].destinations == ("https://api.openai.com/v1",)


def test_verifier_output_is_scrubbed_of_every_readable_credential_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tickets.key"
    path.write_text("tickets-file-secret-0123456789\n")
    monkeypatch.setenv(SECRET_ENV, CANARY)
    configured = Settings(
        credentials={
            "openai": CredentialSpec(env=SECRET_ENV, destinations=(DEST,)),
            "tickets": CredentialSpec(file=path, destinations=(DEST,)),
        }
    )
    scrubbed = Scrubber.from_settings(configured, environ={}).scrub(
        f"leaked {CANARY} and tickets-file-secret-0123456789 here"
    )
    assert CANARY not in scrubbed and "tickets-file-secret" not in scrubbed
    assert CredentialMap(configured.credentials).files() == [path]


def test_worker_processes_get_the_map_and_the_http_token_they_were_configured_with() -> None:
    configured = Settings(
        http_token=SecretStr(CANARY),
        credentials={"openai": CredentialSpec(env=SECRET_ENV, destinations=(DEST,))},
    )
    child = Settings.model_validate_json(_settings_json(configured))
    assert child.credentials == configured.credentials
    assert child.http_token is not None and child.http_token.get_secret_value() == CANARY
