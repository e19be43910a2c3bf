"""The model port: what a model-driven agent asks, and two models that answer.

A :data:`Model` is any callable taking a :class:`ModelRequest` (OpenAI chat messages and
the tools offered, in OpenAI's ``{"type": "function", "function": {...}}`` shape) and
returning a :class:`ModelReply` (text, tool calls, or both). Two ship here:

* :class:`ScriptedModel` plays replies from a list, or computes them from the request
  (tests, demos, drills: no network);
* :class:`OpenAIChatModel` speaks ``POST {base_url}/chat/completions`` (OpenAI's API and
  the many servers compatible with it) with httpx, with bounded retries.

Errors, and why these ones:

* a missing API key (the worker's credential has no secret) is a
  :class:`~ratchet.errors.ConfigurationError` (the worker's configuration is wrong;
  nothing was sent);
* a transport failure, a timeout, or 429 / 5xx after the last retry is an
  :class:`~ratchet.errors.AdapterError` with ``retryable=True``: the model endpoint is an
  edge like an adapter's service, and a worker already treats a retryable adapter error
  from a job as "retry later" (the run keeps its last checkpoint and is handed out again)
  without counting it as the agent's fault;
* any other refusal (400, 401, 404, a reply that is not a chat completion) is an
  :class:`~ratchet.errors.AdapterError` with ``retryable=False``: the job fails and counts
  towards freezing the run, because asking again will not help;
* an answer (any status) past the byte cap is a
  :class:`~ratchet.errors.PeerAnswerTooLargeError` (``retryable=False``, never asked
  again): the body is counted as it streams in and reading stops at the cap
  (``max_answer_bytes``, by default the worker's ``RATCHET_MAX_PEER_BYTES``,
  :mod:`ratchet.limits`); a compressed body is refused unread (an identity encoding is
  asked for).

The API key is a ``SecretStr``, or a callable returning one (a worker's credential bound
to this model's URL, :mod:`ratchet.agents.credentials`) that is called when a request is
made. It is sent only in the ``Authorization`` header and kept nowhere else: not in the
object's repr (which says only whether there is a key), not in a log line, not in an
error (a server's error body, which may quote the key, is never copied into one), not in
the agent's state.

httpx is imported when an :class:`OpenAIChatModel` is built, so the package imports
without it.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, StrictStr, ValidationError

from ratchet.errors import AdapterError, ConfigurationError
from ratchet.limits import AnswerBudget, peer_cap

if TYPE_CHECKING:
    import httpx

__all__ = [
    "Model",
    "ModelReply",
    "ModelRequest",
    "OpenAIChatModel",
    "ScriptedModel",
    "ToolCallRequest",
]

_log = logging.getLogger(__name__)

_ERROR_CODE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# A key goes into a header: one token of visible ASCII (an httpx error about a bad
# header value could quote it).
_KEY = re.compile(r"[\x21-\x7e]{1,16384}")
_RETRYABLE = frozenset({408, 409, 429, 500, 502, 503, 504})


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ToolCallRequest(_Strict):
    """One tool call a model asked for: its id (echoed in the ``tool`` message that
    answers it), the tool's name, and its arguments as the JSON text the model wrote
    (parsed, and refused when malformed, by the agent: never trusted as is)."""

    id: StrictStr
    name: StrictStr
    arguments: StrictStr = "{}"


class ModelReply(_Strict):
    """What a model answered: text, tool calls, or both."""

    content: StrictStr | None = None
    tool_calls: list[ToolCallRequest] = Field(default_factory=list)


class ModelRequest(_Strict):
    """What a model is shown: the conversation (OpenAI chat messages, the system prompt
    first) and the tools it may call (OpenAI function tools with JSON Schemas)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = Field(default_factory=list)


#: A model: called with a request, returns the reply. Raises what it must (see the module
#: docstring); the agent does not catch it, so nothing of the step is committed.
Model = Callable[[ModelRequest], ModelReply]

ScriptedReplies = Sequence[ModelReply | Mapping[str, Any]] | Callable[[ModelRequest], Any]


def _as_reply(value: Any, where: str) -> ModelReply:
    if isinstance(value, ModelReply):
        return value
    try:
        return ModelReply.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ConfigurationError(
            f"{where} is not a model reply: {loc or 'reply'}: {first['msg']}", field=where
        ) from None


class ScriptedModel:
    """A model that plays a script: a list of replies served in order, or a function of
    the request. Every request is kept in :attr:`requests` (what a test asserts on).

    The list's position lives in this object, so a new ``ScriptedModel`` (a new job, a
    new process) plays the script from its start again: a model that repeats itself.

    Raises (constructor):
        ConfigurationError: an empty list, or an entry that is not a reply.
    """

    def __init__(self, replies: ScriptedReplies) -> None:
        self._function: Callable[[ModelRequest], Any] | None = None
        self._replies: list[ModelReply] = []
        if callable(replies):
            self._function = replies
        else:
            self._replies = [_as_reply(r, f"replies[{i}]") for i, r in enumerate(replies)]
            if not self._replies:
                raise ConfigurationError(
                    "a scripted model needs at least one reply", field="replies"
                )
        self.requests: list[ModelRequest] = []

    def __repr__(self) -> str:
        if self._function is not None:
            return "ScriptedModel(function)"
        return f"ScriptedModel(served={len(self.requests)}, replies={len(self._replies)})"

    def __call__(self, request: ModelRequest) -> ModelReply:
        """The next reply.

        Raises:
            AdapterError: the script has no reply left (``retryable=False``).
            ConfigurationError: the function returned something that is not a reply.
        """
        served = len(self.requests)
        self.requests.append(request)
        if self._function is not None:
            return _as_reply(self._function(request), "reply")
        if served >= len(self._replies):
            raise AdapterError(
                f"the scripted model has no reply left ({len(self._replies)} served)",
                retryable=False,
            )
        return self._replies[served]


# -- the OpenAI-compatible client ---------------------------------------------------------


class _Function(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] | None = None


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    function: _Function


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    content: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Choice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    message: _Message


class _Completion(BaseModel):
    model_config = ConfigDict(extra="ignore")
    choices: list[_Choice] = Field(min_length=1)


def _reply_from(completion: _Completion) -> ModelReply:
    message = completion.choices[0].message
    calls = []
    for index, call in enumerate(message.tool_calls or ()):
        raw = call.function.arguments
        # Some servers send the arguments as an object; the agent parses text either way.
        text = raw if isinstance(raw, str) else json.dumps(raw if raw is not None else {})
        calls.append(
            ToolCallRequest(id=call.id or f"call_{index}", name=call.function.name, arguments=text)
        )
    return ModelReply(content=message.content, tool_calls=calls)


def _error_code(response: httpx.Response) -> str:
    """The server's error code when it is a short token (``invalid_api_key``), else "".

    Only the code: an error message may quote what was sent, the key included."""
    try:
        body = response.json()
    except ValueError:
        return ""
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, str) and _ERROR_CODE.fullmatch(code):
        return code
    return ""


class OpenAIChatModel:
    """A chat-completions client (``POST {base_url}/chat/completions``).

    ``api_key`` is the key, or a callable that returns it at each request (None: no
    ``Authorization`` header, for a local server). ``timeout`` bounds each attempt, in
    seconds. A transport failure, a timeout, 408/409/429 or a 5xx is tried again up to
    ``max_retries`` times, after ``backoff_s`` doubling up to ``max_backoff_s`` (or the
    server's ``Retry-After`` seconds, capped the same way). ``sleep`` waits between
    attempts (a test passes one that records). Retries are written out here rather than
    taken from a retry library: the policy is six lines, and it must honour
    ``Retry-After`` and keep every error free of the server's text. ``max_answer_bytes``
    caps one answer's body (None: the process's cap when the model is built).

    Raises (constructor):
        ConfigurationError: a base URL that is not http(s), an empty model name, a bad
            timeout, retry count or cap, or httpx not installed.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: SecretStr | Callable[[], SecretStr] | None = None,
        timeout: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        sleep: Callable[[float], None] = time.sleep,
        transport: httpx.BaseTransport | None = None,
        max_answer_bytes: int | None = None,
    ) -> None:
        try:
            import httpx  # noqa: PLC0415 - here: the package imports without httpx
        except ImportError:
            raise ConfigurationError(
                "the openai model needs the httpx package (pip install httpx)", field="model"
            ) from None
        try:
            url = httpx.URL(base_url)
        except (httpx.InvalidURL, TypeError):
            raise ConfigurationError(
                "model.base_url is not a URL", field="model.base_url"
            ) from None
        if url.scheme not in ("http", "https") or not url.host:
            raise ConfigurationError(
                "model.base_url must be an http(s) URL with a host", field="model.base_url"
            )
        if url.userinfo:
            raise ConfigurationError(
                "model.base_url must not carry credentials (name one in model.credential)",
                field="model.base_url",
            )
        if not model:
            raise ConfigurationError("model.model must name a model", field="model.model")
        if not 0 < timeout <= 3600:
            raise ConfigurationError("model.timeout must be 0..3600 seconds", field="model.timeout")
        if not 0 <= max_retries <= 10:
            raise ConfigurationError("model.max_retries must be 0..10", field="model.max_retries")
        self._httpx = httpx
        self.url = str(url).rstrip("/") + "/chat/completions"
        self.model = model
        self._api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self._backoff = (backoff_s, max_backoff_s)
        self._sleep = sleep
        self._transport = transport
        # What one answer may carry, counted as it streams in (ratchet.limits); the peer
        # is named without the query, which may hold a key.
        self._limit = peer_cap(max_answer_bytes)
        self._peer = f"chat model ({url.scheme}://{url.netloc.decode()}{url.path})"

    def __repr__(self) -> str:
        return (
            f"OpenAIChatModel(url={self.url!r}, model={self.model!r}, "
            f"api_key={'set' if self._api_key is not None else None})"
        )

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key is not None:
            key = self._api_key if isinstance(self._api_key, SecretStr) else self._api_key()
            if not _KEY.fullmatch(key.get_secret_value()):
                raise ConfigurationError(
                    "the model's API key is empty or not one token of visible ASCII",
                    field="model.credential",
                )
            headers["Authorization"] = f"Bearer {key.get_secret_value()}"
        return headers

    def _delay(self, failures: int, response: httpx.Response | None) -> float:
        base, cap = self._backoff
        delay = base * (2 ** (failures - 1))
        if response is not None:
            after = response.headers.get("Retry-After", "")
            if after.isdigit():
                delay = float(after)
        return float(min(delay, cap))

    def __call__(self, request: ModelRequest) -> ModelReply:
        """Ask the model once (with bounded retries).

        Raises:
            ConfigurationError: the key cannot be read (nothing sent).
            AdapterError: see the module docstring (``status`` when the server answered).
        """
        lib = self._httpx
        body: dict[str, Any] = {"model": self.model, "messages": request.messages}
        if request.tools:
            body["tools"] = request.tools
        headers = self._headers()
        attempts = self.max_retries + 1
        failure = ""
        status: int | None = None
        with lib.Client(timeout=self.timeout, transport=self._transport) as client:
            for attempt in range(1, attempts + 1):
                response: httpx.Response | None = None
                try:
                    # Read while it streams in, up to the cap; past it the answer is
                    # refused (PeerAnswerTooLargeError) and never asked for again.
                    sent = {**headers, "Accept-Encoding": "identity"}
                    with client.stream("POST", self.url, json=body, headers=sent) as streamed:
                        response = self._bounded(streamed)
                except lib.TransportError as exc:
                    failure, status = type(exc).__name__, None
                else:
                    status = response.status_code
                    if 200 <= status < 300:
                        return self._parse(response)
                    code = _error_code(response)
                    failure = f"HTTP {status}" + (f" ({code})" if code else "")
                    if status not in _RETRYABLE:
                        raise AdapterError(
                            f"the chat model refused the request: {failure}",
                            retryable=False,
                            status=status,
                        )
                if attempt < attempts:
                    delay = self._delay(attempt, response)
                    _log.info(
                        "chat model attempt %d of %d failed (%s); retrying in %.1fs",
                        attempt,
                        attempts,
                        failure,
                        delay,
                    )
                    self._sleep(delay)
        raise AdapterError(
            f"the chat model failed {attempts} times; last: {failure}",
            retryable=True,
            status=status,
        )

    def _bounded(self, streamed: httpx.Response) -> httpx.Response:
        """``streamed`` read as its bytes arrive, at most the cap: a response holding its
        body. A compressed body (asked for an identity one) is refused unread: it could
        not be bounded before it is inflated.

        Raises:
            PeerAnswerTooLargeError: the body went past the cap; reading stopped there.
        """
        budget = AnswerBudget(self._peer, self._limit)
        encoding = streamed.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            raise budget.refusal(encoding=encoding)
        body = bytearray()
        for chunk in streamed.iter_bytes():  # an identity body: these are its raw bytes
            budget.take(len(chunk))
            body += chunk
        return self._httpx.Response(
            streamed.status_code,
            headers=streamed.headers,
            content=bytes(body),
            request=streamed.request,
        )

    def _parse(self, response: httpx.Response) -> ModelReply:
        try:
            completion = _Completion.model_validate_json(response.content)
        except ValidationError:
            raise AdapterError(
                "the chat model's reply is not a chat completion",
                retryable=False,
                status=response.status_code,
            ) from None
        try:
            return _reply_from(completion)
        except ValidationError:
            raise AdapterError(
                "the chat model's reply holds a malformed tool call",
                retryable=False,
                status=response.status_code,
            ) from None
