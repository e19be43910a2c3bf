"""Helpers for the tests of the byte cap on peers' answers (``ratchet.limits``).

:class:`Flood` starts a flooding peer (``ratchet.testing.flood``) for a test and stops it.

:func:`probe` makes one call to a flooding peer in a **child process** through the real
client (an MCP connection over stdio or streamable HTTP, the chat-model client, the HTTP
adapter) and reports, as JSON, the error the call raised (type, typed fields, what it was
raised from) and the child's memory: its resident set just before the call and its peak
during it (``VmHWM`` in ``/proc/self/status``, reset just before the call by writing 5 to
``/proc/self/clear_refs``). The client is warmed up first (one small call), so the
measure is the call's own. Run as ``python -m tests.tools.peer_probe CASE CONFIG_JSON``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 20.0
MIB = 1 << 20


class Flood:
    """``python -m ratchet.testing.flood KIND ARGS`` for the length of a ``with`` block;
    ``port`` is where it listens (HTTP kinds), ``calls`` what reached it."""

    def __init__(self, folder: Path, kind: str, *args: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.kind = kind
        self.args = args
        self.calls_file = folder / "calls"
        self.port_file = folder / "port"
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "ratchet.testing.flood",
            self.kind,
            "--calls",
            str(self.calls_file),
            *self.args,
        ]

    def __enter__(self) -> Flood:
        if self.kind == "mcp-stdio":
            return self  # the client starts it (argv())
        self.process = subprocess.Popen(
            [*self.argv(), "--port-file", str(self.port_file)], cwd=ROOT
        )
        deadline = time.monotonic() + DEADLINE_S
        while not self.port_file.exists():
            if self.process.poll() is not None:
                raise AssertionError(f"the flood server exited ({self.process.returncode})")
            if time.monotonic() > deadline:
                raise AssertionError(f"the flood server did not listen within {DEADLINE_S}s")
            time.sleep(0.02)
        self.port = int(self.port_file.read_text())
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(DEADLINE_S)

    def url(self, path: str = "/mcp") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def calls(self) -> list[str]:
        """What reached the server, in order (tool names, or ``METHOD PATH``)."""
        if not self.calls_file.exists():
            return []
        return self.calls_file.read_text().splitlines()


def probe(case: str, **config: Any) -> dict[str, Any]:
    """Run ``case`` in a child process (see the module docstring); its report."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.tools.peer_probe", case, json.dumps(config)],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return report


# -- the child's side --------------------------------------------------------------------------


def _kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    if found is None:
        raise AssertionError(f"/proc/self/status has no {field}")
    return int(found.group(1))


def _measured(call: Callable[[], Any]) -> dict[str, Any]:
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
    baseline = _kib("VmRSS")
    error: BaseException | None = None
    try:
        call()
    except Exception as exc:
        error = exc
    report: dict[str, Any] = {"baseline_kib": baseline, "peak_kib": _kib("VmHWM")}
    if error is not None:
        context = getattr(error, "context", {})
        report["error"] = type(error).__name__
        report["context"] = {
            k: v for k, v in context.items() if isinstance(v, str | int | bool | None)
        }
        report["cause"] = type(error.__cause__).__name__ if error.__cause__ else None
    return report


def _mcp(config: dict[str, Any]) -> dict[str, Any]:
    from ratchet.tools.mcp import MCPConnection

    limit = int(config["limit"])
    if "argv" in config:
        conn = MCPConnection.stdio(config["argv"], max_answer_bytes=limit, timeout_s=60)
    else:
        conn = MCPConnection.http(config["url"], max_answer_bytes=limit, timeout_s=60)
    with conn:
        conn.call_tool("echo", {})  # warm: every code path of a call has run once
        return _measured(lambda: conn.call_tool(config.get("tool", "flood_read"), {}))


def _chat(config: dict[str, Any]) -> dict[str, Any]:
    from ratchet.agents.models import ModelRequest, OpenAIChatModel

    def model(url: str) -> OpenAIChatModel:
        return OpenAIChatModel(
            url, "m", max_answer_bytes=int(config["limit"]), sleep=lambda _: None
        )

    request = ModelRequest(messages=[{"role": "user", "content": "hello"}])
    try:
        model(config["warm_url"])(request)  # a small 404: every code path has run once
    except Exception as exc:
        if type(exc).__name__ != "AdapterError":
            raise
    flooded = model(config["base_url"])
    return _measured(lambda: flooded(request))


def _http_adapter(config: dict[str, Any]) -> dict[str, Any]:
    from ratchet.adapters.http import HttpAdapter

    warm = HttpAdapter(config["warm_url"], max_reply_bytes=int(config["limit"]))
    try:
        warm.observe()  # a small 404: every code path has run once
    except Exception as exc:
        if type(exc).__name__ != "AdapterError":
            raise
    flooded = HttpAdapter(config["base_url"], max_reply_bytes=int(config["limit"]))
    return _measured(flooded.observe)


CASES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "mcp": _mcp,
    "chat": _chat,
    "http-adapter": _http_adapter,
}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    print(json.dumps(CASES[sys.argv[1]](json.loads(sys.argv[2]))))
