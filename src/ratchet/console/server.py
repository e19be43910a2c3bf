"""The console's HTTP server: standard library only, GET and HEAD only, loopback by default.

Choice: ``http.server.ThreadingHTTPServer`` and server-side HTML. The console is a handful
of read-only pages for a few operators; a web framework would add a dependency and an
attack surface for nothing. There is no JavaScript at all, so the Content-Security-Policy
can forbid every script, every inline style, frames and form targets off-site.

Routes::

    GET /                     the runs list (same as /runs)
    GET /runs?phase=&q=&sort=&after=&refresh=&limit=
                              one page of runs from the store's indexes, newest first
                              (sort=oldest: oldest first), in one phase, searched by an
                              exact prefix of run id, task id or lease owner (q; owner=
                              is the same search), continuing after a page's cursor; a
                              q that names a run exactly answers 303 to that run's page;
                              refresh=N (10..3600 s) reloads the page every N seconds
    GET /runs/<run_id>        one run
    GET /reviews              the review queue (newest first, exact counts)
    GET /workers              the workers RQ knows (heartbeats), and the queue's depth
    GET /metrics              fleet gauges in Prometheus text format
    GET /healthz              "ok"
    GET /static/console.css   the style sheet

Every other method answers 405 and reads no body: there is no write endpoint, and signing
stays with the command line, where the private keys are.

Only its own origin is answered. A request whose ``Host`` header is not the address the
console is bound to (or ``localhost`` / ``127.0.0.1`` / ``[::1]``), with its port, gets
``421 Misdirected Request`` and no page: a web page the operator visits cannot rebind its
own name to 127.0.0.1 and read pending writes, approval evidence or review cases. Behind
a reverse proxy, the names it forwards are added with ``allowed_hosts`` (``ratchet
console --allow-host``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ratchet.console.data import (
    DEFAULT_PAGE,
    ConsoleData,
    RunQuery,
    list_page,
    run_counts,
    waiting_runs,
)
from ratchet.console.gauges import QueueGauges
from ratchet.console.pages import (
    CSS,
    SORTS,
    error_page,
    review_queue_page,
    run_page,
    runs_page,
    workers_page,
)
from ratchet.errors import (
    AdapterError,
    ConfigurationError,
    ContractError,
    IntegrityError,
    RatchetError,
    RunNotFoundError,
    StoreError,
)
from ratchet.runtime import Phase

__all__ = ["CSP", "ConsoleServer", "own_hosts", "serve_console"]

log = logging.getLogger("ratchet.console")

CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "base-uri 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
_MAX_PATH = 2048
#: The errors that may say why with a short code (shown beside the message).
_GIVES_A_REASON = (IntegrityError, StoreError, AdapterError)
_PHASES = frozenset(p.value for p in Phase)


class _FleetGauges:
    """Runs by phase and runs waiting for a human, read when Prometheus scrapes: exact
    counts of the store's indexes (``ZCARD``), whatever the fleet's size."""

    def __init__(self, data: ConsoleData) -> None:
        self._data = data

    def collect(self) -> Any:
        by_phase, total = run_counts(self._data)
        runs = GaugeMetricFamily(
            "ratchet_runs",
            "Runs by phase (unindexed: runs in no phase index, created before phase indexes).",
            labels=["phase"],
        )
        counts = {phase: by_phase.get(phase, 0) for phase in sorted(_PHASES)}
        counts["unindexed"] = max(0, total - sum(counts.values()))
        for phase, count in counts.items():
            runs.add_metric([phase], count)
        yield runs
        waiting = GaugeMetricFamily(
            "ratchet_approvals_waiting", "Runs waiting for a signed approval."
        )
        waiting.add_metric([], counts[Phase.AWAITING_APPROVAL.value])
        yield waiting
        reviews = GaugeMetricFamily(
            "ratchet_reviews_waiting", "Runs frozen in needs_review, waiting for a reviewer."
        )
        reviews.add_metric([], counts[Phase.NEEDS_REVIEW.value])
        yield reviews


def own_hosts(bound: str, port: int, extra: Iterable[str] = ()) -> frozenset[str]:
    """The ``Host`` values the console answers: the bound address and the loopback names,
    each with the port (and without it on port 80), plus ``extra`` names as given
    (``name`` or ``name:port``, compared case-insensitively)."""
    names = {bound, "localhost", "127.0.0.1", "[::1]"}
    if ":" in bound and not bound.startswith("["):
        names.add(f"[{bound}]")
    hosts = {f"{name}:{port}" for name in names}
    if port == 80:
        hosts |= names
    hosts |= {h.strip() for h in extra if h.strip()}
    return frozenset(h.lower() for h in hosts)


class ConsoleServer(ThreadingHTTPServer):
    """A threading HTTP server bound to one :class:`ConsoleData`."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], data: ConsoleData, *, allowed_hosts: Iterable[str] = ()
    ) -> None:
        super().__init__(address, _Handler)
        self.data = data
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_FleetGauges(data))
        self.registry.register(QueueGauges(data))
        self.allowed_hosts = own_hosts(
            str(self.server_address[0]), int(self.server_address[1]), allowed_hosts
        )

    @property
    def url(self) -> str:
        host, port = self.server_address[0], self.server_address[1]
        return f"http://{host!s}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: ConsoleServer
    server_version = "ratchet-console"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("request", extra={"outcome": format % args})

    # -- no writes, ever -------------------------------------------------------------

    def _refuse(self) -> None:
        self.close_connection = True
        if not self._own_origin():
            return
        self._send(
            HTTPStatus.METHOD_NOT_ALLOWED,
            b"read-only: GET and HEAD only\n",
            "text/plain; charset=utf-8",
            extra={"Allow": "GET, HEAD"},
        )

    def _own_origin(self) -> bool:
        """True when the request names this console in ``Host``; otherwise answer 421
        (nothing of any run in it) and close."""
        host = (self.headers.get("Host") or "").strip().lower()
        if host and host in self.server.allowed_hosts:
            return True
        self.close_connection = True
        self._send(
            HTTPStatus.MISDIRECTED_REQUEST,
            b"this console answers only its own address\n",
            "text/plain; charset=utf-8",
        )
        log.warning("request for another host refused", extra={"outcome": "421"})
        return False

    do_POST = do_PUT = do_PATCH = do_DELETE = _refuse  # noqa: N815 - http.server's names
    do_OPTIONS = do_TRACE = do_CONNECT = _refuse  # noqa: N815

    # -- reads -----------------------------------------------------------------------

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def _send(
        self,
        status: HTTPStatus,
        body: bytes,
        content_type: str,
        *,
        head: bool = False,
        extra: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        for name, value in {**_HEADERS, **(extra or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _html(self, status: HTTPStatus, page: str, head: bool) -> None:
        self._send(status, page.encode("utf-8"), "text/html; charset=utf-8", head=head)

    def _dispatch(self, *, head: bool) -> None:
        if not self._own_origin():
            return
        if len(self.path) > _MAX_PATH:
            self._html(
                HTTPStatus.REQUEST_URI_TOO_LONG, error_page("too long", "URI too long"), head
            )
            return
        parts = urlsplit(self.path)
        path, query = parts.path, parse_qs(parts.query, max_num_fields=10)
        data = self.server.data
        try:
            if path in ("/", "/runs"):
                page, location = self._runs(query)
                if location is not None:
                    self._send(
                        HTTPStatus.SEE_OTHER,
                        b"",
                        "text/plain; charset=utf-8",
                        head=head,
                        extra={"Location": location},
                    )
                else:
                    self._html(HTTPStatus.OK, page, head)
            elif path.startswith("/runs/") and path.count("/") == 2:
                run_id = unquote(path.removeprefix("/runs/"))
                now = data.now()
                self._html(HTTPStatus.OK, run_page(data.run_detail(run_id, now), now=now), head)
            elif path == "/reviews":
                reviews, approvals, broken = waiting_runs(data)
                counts, _total = run_counts(data)
                self._html(
                    HTTPStatus.OK,
                    review_queue_page(reviews, approvals, broken, now=data.now(), counts=counts),
                    head,
                )
            elif path == "/workers":
                self._html(HTTPStatus.OK, self._workers(), head)
            elif path == "/static/console.css":
                self._send(HTTPStatus.OK, CSS.encode(), "text/css; charset=utf-8", head=head)
            elif path == "/metrics":
                self._send(
                    HTTPStatus.OK,
                    generate_latest(self.server.registry),
                    "text/plain; version=0.0.4; charset=utf-8",
                    head=head,
                )
            elif path == "/healthz":
                self._send(HTTPStatus.OK, b"ok\n", "text/plain; charset=utf-8", head=head)
            else:
                self._html(HTTPStatus.NOT_FOUND, error_page("not found", unquote(path)), head)
        except RunNotFoundError as exc:
            self._html(HTTPStatus.NOT_FOUND, error_page("no such run", exc.message), head)
        except RatchetError as exc:
            # Unverifiable checkpoint, unreachable store: say so, show nothing unverified.
            reason = exc.reason if isinstance(exc, _GIVES_A_REASON) else None
            text = f"{exc.message}" + (f" (reason: {reason})" if reason else "")
            self._html(HTTPStatus.CONFLICT, error_page("cannot show this", text), head)
        except Exception as exc:
            log.error("console page failed", extra={"error": type(exc).__name__})
            self._html(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                error_page("cannot show this", f"unreadable: {type(exc).__name__}"),
                head,
            )

    def _workers(self) -> str:
        data = self.server.data
        return workers_page(data.list_workers() if data.list_workers is not None else None)

    def _runs(self, query: dict[str, list[str]]) -> tuple[str, str | None]:
        """The runs list page, or where to redirect (a search naming one run exactly).
        A bad parameter is never an error page: the page says what it ignored."""
        data = self.server.data

        def first(name: str) -> str:
            return ((query.get(name) or [""])[0]).strip()

        notices = []
        phase = first("phase") or None
        if phase is not None and phase not in _PHASES:
            notices.append(f"unknown phase {phase!r}: showing every phase")
            phase = None
        search = (first("q") or first("owner"))[:200] or None
        sort = first("sort") or "newest"
        if sort not in SORTS:
            notices.append(f"unknown order {sort!r}: newest first")
            sort = "newest"
        refresh = _bounded(first("refresh"), 0, low=10, high=3600)
        limit = _bounded(first("limit"), DEFAULT_PAGE, low=1, high=200)
        if search is not None and data.run_exists is not None and data.run_exists(search):
            return "", f"/runs/{quote(search, safe='')}"
        run_query = RunQuery(
            phase=phase,
            search=search,
            after=first("after") or None,
            oldest_first=SORTS[sort],
            limit=limit,
        )
        try:
            listing = list_page(data, run_query)
        except ContractError as exc:
            if exc.field != "after":
                raise
            notices.append(f"{exc.message}: showing the first page")
            run_query = RunQuery(phase=phase, search=search, oldest_first=SORTS[sort], limit=limit)
            listing = list_page(data, run_query)
        return runs_page(
            listing, run_query, sort=sort, refresh=refresh, notice="; ".join(notices) or None
        ), None


def _bounded(text: str, default: int, *, low: int, high: int) -> int:
    """A whole number from a query parameter, clamped to ``low..high``; ``default`` when
    absent or not a number (``0`` stays 0: off)."""
    if not text.isdigit() or len(text) > 9:
        return default
    value = int(text)
    return 0 if value == 0 and default == 0 else min(max(value, low), high)


def serve_console(
    data: ConsoleData,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    background: bool = False,
    allowed_hosts: Iterable[str] = (),
) -> ConsoleServer:
    """Bind the console. ``background=True`` serves from a daemon thread and returns;
    otherwise the caller runs ``serve_forever()``. Port 0 picks a free port.
    ``allowed_hosts`` adds ``Host`` names beyond the console's own (a reverse proxy's).

    Raises ConfigurationError when the address cannot be bound.
    """
    try:
        server = ConsoleServer((host, port), data, allowed_hosts=allowed_hosts)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}", field="port"
        ) from None
    if background:
        threading.Thread(target=server.serve_forever, name="ratchet-console", daemon=True).start()
    return server
