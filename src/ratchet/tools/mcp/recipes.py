"""Lookup recipes: how a write to a server that knows no idempotency keys keeps its key
where the server's own reads show it, and how recovery finds it again, declared without
Python (``McpDeclaration(keys=...)``, docs/mcp.md "Lookup recipes").

A recipe names the write's string argument that carries the key (``carry``) and a read
tool of the same server, called with fixed ``arguments`` in which ``{key}`` stands for
the key. The key is carried one of two ways:

* **a trailer** (``placeholder=None``): ``carry`` gets a last line ``Ratchet-Key: KEY`` (a
  commit message's trailer, a ticket's body), and the read must show that line;
* **a placeholder** (``placeholder=":ratchet_key"``): the agent writes the placeholder
  where the key goes (``INSERT INTO notes (body, ratchet_key) VALUES ('hi',
  :ratchet_key)``) and ratchet fills it in before the call, so the key lands in the row; a
  call whose ``carry`` lacks the placeholder is refused before anything is sent (without
  the key in the row, no read could find the call). The read must show the key.
  ``intent_placeholder`` does the same with the call's intent digest: a read that shows
  it tells which intent made the row (a key found under another intent opens a review).

The action's arguments, as the agent proposed them, keep the placeholder: the intent
digest covers them, and the pending intent binds the key to that digest, so the text
sent is fixed by the two before anything is sent.

Keys are written into the text a server runs (a query), so a key is never escaped blindly:
it must be of ratchet's identifier alphabet (:data:`~ratchet.runtime.types.
IDENTIFIER_PATTERN`: letters, digits and ``._:@/+-``, no quote, no backslash, no blank),
or the call is refused. ``quote="sql"`` writes it as a SQL string literal (``'KEY'``).

Shipped recipes: :func:`git_trailer` (``mcp-server-git``: the key in the commit message's
trailer, found by ``git_log``) and :func:`sql_key_column` (a SQL server's ``write_query``:
the key in a column of the row, found by ``read_query``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import mcp_types

from ratchet.errors import AdapterError, ConfigurationError
from ratchet.runtime.types import IDENTIFIER_PATTERN
from ratchet.tools.declare import Found

__all__ = [
    "KEY_LINE",
    "KEY_TOKEN",
    "KeyRecipe",
    "git_trailer",
    "sql_key_column",
]

#: The line a trailer recipe adds to the write's carrying argument, and looks for.
KEY_LINE = "Ratchet-Key: {key}"
#: What stands for the key in a recipe's lookup arguments.
KEY_TOKEN = "{key}"  # noqa: S105 - a placeholder's text, not a secret
_KEY = re.compile(IDENTIFIER_PATTERN)
_KEY_MAX = 200
# A key is found as a whole token: not inside a longer key, identifier or digest.
_KEY_CHAR = r"A-Za-z0-9._:@/+-"
_DIGEST = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
_SQL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")

Quote = Literal["text", "sql"]


def _checked_key(key: str, tool: str) -> str:
    """``key`` if it is of the identifier alphabet (what may be written into a query).

    Raises:
        AdapterError: it is not (retryable=False: nothing was sent).
    """
    if not (0 < len(key) <= _KEY_MAX and _KEY.match(key) and "\n" not in key):
        raise AdapterError(
            f"tool {tool}: the idempotency key is not of ratchet's key alphabet, so it is not "
            "written into the call; nothing was sent",
            retryable=False,
            tool=tool,
        )
    return key


def _answer_texts(result: mcp_types.CallToolResult) -> list[str]:
    """Every text of a read's answer, whole (the byte cap bounded it already): its text
    contents joined, and its structured content as JSON."""
    texts = ["\n".join(b.text for b in result.content if isinstance(b, mcp_types.TextContent))]
    if result.structured_content is not None:
        texts.append(json.dumps(result.structured_content))
    return texts


@dataclass(frozen=True, slots=True)
class KeyRecipe:
    """How a write's key is kept and found again (see the module docstring).

    ``carry``: the write's string argument that carries the key. ``tool`` and
    ``arguments``: the read a lookup makes (``{key}`` in a string of ``arguments`` is
    replaced by the key, written as ``quote`` says). ``placeholder``: None for a trailer
    line, else the text in ``carry`` that the key replaces (required there).
    ``intent_placeholder``: the text in ``carry`` that the call's intent digest replaces
    (required there too when set; a placeholder recipe only). ``absent``: a regular
    expression; when set, a read that does not show the key counts as "no such call" only
    if its text matches it (an error a server answers as ordinary text is then never taken
    for absence).

    The read must see every call of the run that could have been made (the newest commits
    of the run's branch, the rows of the run's table): a key it cannot see is taken as
    never sent, and the call is made again.

    Raises (constructor):
        ConfigurationError: an empty placeholder, an intent placeholder without a key
            placeholder, an unknown ``quote``, an ``absent`` that is not a regular
            expression.
    """

    carry: str
    tool: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    placeholder: str | None = None
    quote: Quote = "text"
    intent_placeholder: str | None = None
    absent: str | None = None

    def __post_init__(self) -> None:
        if self.quote not in ("text", "sql"):
            raise ConfigurationError(
                f"a key recipe's quote is 'text' or 'sql', not {self.quote!r}", field="declare"
            )
        if self.placeholder is not None and not self.placeholder.strip():
            raise ConfigurationError("a key recipe's placeholder is empty", field="declare")
        if self.intent_placeholder is not None and (
            self.placeholder is None or not self.intent_placeholder.strip()
        ):
            raise ConfigurationError(
                "a key recipe's intent placeholder needs a key placeholder beside it",
                field="declare",
            )
        both = (self.placeholder or "", self.intent_placeholder or "")
        if all(both) and (both[0] in both[1] or both[1] in both[0]):
            raise ConfigurationError(
                "a key recipe's two placeholders must not contain each other", field="declare"
            )
        if self.absent is not None:
            try:
                re.compile(self.absent)
            except re.error as exc:
                raise ConfigurationError(
                    f"a key recipe's absent pattern is not a regular expression ({exc})",
                    field="declare",
                ) from None

    # -- the write ---------------------------------------------------------------------------

    def _written(self, value: str) -> str:
        return f"'{value}'" if self.quote == "sql" else value

    @property
    def note(self) -> str:
        """What a model is told beside the tool's own description (placeholder recipes)."""
        if self.placeholder is None:
            return ""
        intent = (
            f" and {self.intent_placeholder} where its intent digest goes"
            if self.intent_placeholder is not None
            else ""
        )
        return (
            f" Write {self.placeholder} in {self.carry!r} where the call's idempotency key "
            f"goes{intent}: ratchet fills it in. A call without it is refused."
        )

    def missing(self, arguments: Mapping[str, Any]) -> str | None:
        """Why ``arguments`` (as proposed) cannot carry the key, or None: the carrying
        argument lacks a placeholder this recipe requires."""
        if self.placeholder is None:
            return None
        carried = arguments.get(self.carry)
        for needed in (self.placeholder, self.intent_placeholder):
            if needed is not None and not (isinstance(carried, str) and needed in carried):
                return (
                    f"{self.carry!r} must hold {needed} where ratchet writes the call's "
                    f"{'key' if needed == self.placeholder else 'intent digest'}"
                )
        return None

    def carried(
        self, arguments: dict[str, Any], key: str, intent_digest: str | None, tool: str
    ) -> dict[str, Any]:
        """``arguments`` as sent: the key (and intent digest) written into ``carry``.

        Raises:
            AdapterError: the key is not of the key alphabet, or ``carry`` lacks a
                placeholder (retryable=False: nothing was sent).
        """
        key = _checked_key(key, tool)
        sent = dict(arguments)
        carried = sent.get(self.carry)
        if self.placeholder is None:
            line = KEY_LINE.format(key=key)
            sent[self.carry] = f"{carried}\n\n{line}" if carried else line
            return sent
        why = self.missing(sent)
        if why is not None:
            raise AdapterError(f"tool {tool}: {why}; nothing was sent", retryable=False, tool=tool)
        text = str(carried)
        if self.intent_placeholder is not None:
            if intent_digest is None or not _DIGEST.fullmatch(intent_digest):
                raise AdapterError(
                    f"tool {tool}: the call has no intent digest to write; nothing was sent",
                    retryable=False,
                    tool=tool,
                )
            text = text.replace(self.intent_placeholder, self._written(intent_digest))
        sent[self.carry] = text.replace(self.placeholder, self._written(key))
        return sent

    # -- the lookup ------------------------------------------------------------------------

    def lookup_arguments(self, key: str, tool: str) -> dict[str, Any]:
        """The read's arguments, ``{key}`` replaced by the key (quoted as ``quote`` says).

        Raises:
            AdapterError: the key is not of the key alphabet (retryable=False).
        """
        written = self._written(_checked_key(key, tool))

        def filled(value: Any) -> Any:
            if isinstance(value, str):
                return value.replace(KEY_TOKEN, written)
            if isinstance(value, Mapping):
                return {k: filled(v) for k, v in value.items()}
            if isinstance(value, list):
                return [filled(v) for v in value]
            return value

        return {name: filled(value) for name, value in self.arguments.items()}

    def _shows(self, text: str, key: str) -> bool:
        if self.placeholder is None:
            # The line on its own: in plain text (a log, indented or not) or inside a JSON
            # string, where the line break is escaped.
            line = re.escape(KEY_LINE.format(key=key))
            pattern = rf'(?:^|\n|\\n)[ \t]*{line}(?=$|[\s"\\,}}\]])'
            return re.search(pattern, text, re.MULTILINE) is not None
        token = rf"(?<![{_KEY_CHAR}]){re.escape(key)}(?![{_KEY_CHAR}])"
        return re.search(token, text) is not None

    def found(
        self, result: mcp_types.CallToolResult, key: str, intent_digest: str | None, tool: str
    ) -> Any | None:
        """What the read's ``result`` says of ``key``: None (no such call), the output
        recovery keeps, or a :class:`~ratchet.tools.declare.Found` naming the intent the
        read shows (an intent recipe). ``intent_digest`` is the recorded call's, if known:
        when the read shows several intents, one that differs from it is named.

        Raises:
            AdapterError: the read neither shows the key nor matches ``absent``, or shows
                several intents and the call's own is not known (retryable=True: the key
                stays unknown).
        """
        texts = _answer_texts(result)
        if not any(self._shows(text, key) for text in texts):
            if self.absent is not None and not any(re.search(self.absent, text) for text in texts):
                raise AdapterError(
                    f"tool {tool}: the lookup's read {self.tool!r} neither shows the key nor "
                    "says there is none; the key stays unknown",
                    retryable=True,
                    tool=tool,
                )
            return None
        output = {"found_by": self.tool, "key": key}
        if self.intent_placeholder is None:
            return output
        shown = sorted({d for text in texts for d in _DIGEST.findall(text)} - {key})
        if not shown:
            return output  # the key alone binds the intent the run committed with it
        if len(shown) == 1:
            return Found(output, shown[0])
        other = [d for d in shown if d != intent_digest]
        if intent_digest is None or not other:
            raise AdapterError(
                f"tool {tool}: the lookup's read {self.tool!r} shows the key under several "
                "intents; the key stays unknown",
                retryable=True,
                tool=tool,
            )
        return Found(output, other[0])  # another intent used this key: a review


def git_trailer(
    repo_path: str,
    *,
    message_argument: str = "message",
    log_tool: str = "git_log",
    max_count: int = 50,
) -> KeyRecipe:
    """The recipe for ``mcp-server-git``'s ``git_commit``: the key rides in the commit
    message as a trailer line ``Ratchet-Key: KEY``; a lookup reads the newest
    ``max_count`` commits of ``repo_path`` with ``git_log`` and looks for that line.

    Raises:
        ConfigurationError: ``max_count`` below 1.
    """
    if max_count < 1:
        raise ConfigurationError("git_trailer: max_count must be at least 1", field="declare")
    return KeyRecipe(
        carry=message_argument,
        tool=log_tool,
        arguments={"repo_path": repo_path, "max_count": max_count},
    )


def sql_key_column(
    table: str,
    column: str = "ratchet_key",
    *,
    intent_column: str | None = None,
    query_argument: str = "query",
    read_tool: str = "read_query",
    placeholder: str = ":ratchet_key",
    intent_placeholder: str = ":ratchet_intent",
) -> KeyRecipe:
    """The recipe for a SQL server's write tool (``mcp-server-sqlite``'s ``write_query``):
    the agent's statement names ``placeholder`` where the row's ``column`` value goes,
    ratchet writes the key there as a string literal, and a lookup selects the row with
    ``read_tool`` (``SELECT column FROM table WHERE column = 'KEY'``). An answer that is
    not an empty list (``[]``) and does not show the key is not taken for absence. With
    ``intent_column``, the statement must also name ``intent_placeholder`` (the call's
    intent digest) and the lookup selects it too.

    Make the column ``UNIQUE``: a second row with one key is then refused by the
    database itself.

    Raises:
        ConfigurationError: a table or column name that is not a plain SQL name
            (letters, digits, ``_``): names are written into the query, never quoted
            blindly.
    """
    for name in (table, column, intent_column):
        if name is not None and not _SQL_NAME.match(name):
            raise ConfigurationError(
                f"sql_key_column: {name!r} is not a plain SQL name", field="declare"
            )
    selected = column if intent_column is None else f"{column}, {intent_column}"
    return KeyRecipe(
        carry=query_argument,
        tool=read_tool,
        arguments={
            # Names checked above; the key is quoted by the recipe (quote="sql").
            query_argument: f"SELECT {selected} FROM {table} WHERE {column} = {KEY_TOKEN}"  # noqa: S608
        },
        placeholder=placeholder,
        quote="sql",
        intent_placeholder=intent_placeholder if intent_column is not None else None,
        absent=r"\A\s*\[\s*\]\s*\Z",
    )
