"""What the benchmark scripts share: their Redis server, command line, statistics and output.

* :func:`redis_server` / :func:`temp_redis`: a real ``redis-server`` in a folder of its
  own; by default with ``appendonly yes`` and ``appendfsync always``, so every
  acknowledged write is on disk before the reply (what a durable figure must pay);
* :func:`parser` and :func:`parse_args`: the command line, with the ``--quick`` (smoke
  run) and ``--json`` (one JSON object on stdout) options every script spells the same way;
* :func:`median`, :func:`ratio`, :func:`median_of_ratios`: the statistics the reports
  are made of (a ratio of two figures, e.g. of two medians, is ``None`` when either is
  missing);
* :func:`emit`, :func:`print_table`, :func:`print_measures`: a report printed as one JSON
  object or as a table;
* :data:`SECRET`, :func:`keyring`, :func:`payload_text`, :func:`random_bytes`: the
  benchmark-only signing key and the payloads the contenders store.

The scripts are run as files (``python benchmarks/<script>.py``), so this module is found
next to them; processes they spawn inherit the same import path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ratchet.redis_server import RedisServer
    from ratchet.runtime.signing import KeyRing

__all__ = [
    "SECRET",
    "emit",
    "keyring",
    "median",
    "median_of_ratios",
    "parse_args",
    "parser",
    "payload_text",
    "print_measures",
    "print_table",
    "random_bytes",
    "ratio",
    "redis_server",
    "temp_redis",
]

# Benchmark only: signs the checkpoints of throw-away runs on a throw-away server.
SECRET = b"benchmark-only-checkpoint-key-0123456789abcdef"


# -- Redis ----------------------------------------------------------------------------------


def redis_server(folder: Path, *, aof: bool = True, extra_args: Sequence[str] = ()) -> RedisServer:
    """A ``redis-server`` (not started yet) whose data lives in ``folder / "redis"``.

    With ``aof`` (the default): ``appendonly yes`` and ``appendfsync always``, every
    acknowledged write is fsync'd to the AOF first. Without it nothing is persisted (for
    benchmarks that only read). ``extra_args`` go to the server's command line as given.
    """
    from ratchet.redis_server import RedisServer

    return RedisServer(
        folder / "redis", appendonly=aof, appendfsync="always", extra_args=extra_args
    )


@contextmanager
def temp_redis(prefix: str | None = None) -> Iterator[tuple[RedisServer, Path]]:
    """A started :func:`redis_server` with AOF ``always`` in a new temporary folder.

    Yields the server and the folder (the script may keep its own files there); on exit
    the server is stopped and the folder removed.
    """
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        folder = Path(tmp)
        with redis_server(folder) as server:
            yield server, folder


# -- the command line -----------------------------------------------------------------------


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser described by the first paragraph of the script's docstring."""
    return argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])


def parse_args(
    cli: argparse.ArgumentParser, argv: list[str] | None, *, quick: str | None = None
) -> argparse.Namespace:
    """Add the shared options after the script's own and parse ``argv``.

    ``--quick`` (``args.quick``) is added when ``quick`` is given, with it as its help;
    ``--json`` (``args.json``) always. Bad arguments exit with argparse's usage error.
    """
    if quick is not None:
        cli.add_argument("--quick", action="store_true", help=quick)
    cli.add_argument("--json", action="store_true", help="print one JSON object")
    return cli.parse_args(argv)


# -- statistics -----------------------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    """The median of ``values``; ValueError when there are none."""
    data = list(values)
    if not data:
        raise ValueError("the median of no values is undefined")
    return float(statistics.median(data))


def ratio(num: float | None, den: float | None, digits: int) -> float | None:
    """``num / den`` rounded to ``digits``; None when either is missing or zero."""
    if not num or not den:
        return None
    return round(num / den, digits)


def median_of_ratios(num: Sequence[float], den: Sequence[float], digits: int) -> float:
    """The median of the pairwise ratios ``num[i] / den[i]`` (samples of the same batches,
    so drift hits both sides alike), rounded to ``digits``.

    Raises ValueError when the two differ in length or are empty.
    """
    if len(num) != len(den):
        raise ValueError(f"paired samples differ in length: {len(num)} and {len(den)}")
    return round(median(n / d for n, d in zip(num, den, strict=True)), digits)


# -- output ---------------------------------------------------------------------------------


def emit(
    report: dict[str, Any],
    *,
    as_json: bool,
    table: Callable[[dict[str, Any]], None],
    indent: int | None = None,
    sort_keys: bool = True,
) -> None:
    """Print ``report`` as one JSON object on stdout, or as ``table`` prints it."""
    if as_json:
        print(json.dumps(report, indent=indent, sort_keys=sort_keys))
    else:
        table(report)


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    caption: str | None = None,
) -> None:
    """A rich table: the first column left-aligned (the measure), the others right."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


def print_measures(report: dict[str, Any], title: str) -> None:
    """Every entry of ``report`` as a row of a two-column table (measure, value); a
    missing value is shown as ``-``, a mapping as ``key value, ...``."""
    print_table(title, ("measure", "value"), ((k, _shown(v)) for k, v in report.items()))


# -- keys and payloads ----------------------------------------------------------------------


def keyring(kid: str = "k1") -> KeyRing:
    """A key ring that signs with :data:`SECRET` under ``kid``."""
    from ratchet.runtime.signing import KeyRing

    return KeyRing.from_secrets({kid: SECRET}, signing_kid=kid)


def payload_text(size: int) -> str:
    """A fixed printable payload of ``size`` characters (the same in every process and
    run, so every contender stores the same bytes)."""
    if size < 0:
        raise ValueError(f"payload size must not be negative: {size}")
    seed = hashlib.sha256(b"ratchet-bench-payload").hexdigest()
    return (seed * (size // len(seed) + 1))[:size]


def random_bytes(size: int) -> bytes:
    """``size`` random bytes (which no encoding can shrink)."""
    return os.urandom(size)
