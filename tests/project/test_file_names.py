"""A file name means one thing across the product packages: the names kept in more than
one package are the ones docs/architecture.md ("File names") lists, each one meaning seen
from different layers. A new duplicate fails here until it is renamed or listed."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "ratchet"

PRODUCT = (
    "runtime", "leasing", "adapters", "agents", "tools", "fleet", "worker", "ops", "console",
    "langgraph", "integrations", "cli",
)  # fmt: skip

KEPT = {
    "credentials.py": ["agents", "fleet"],
    "heartbeat.py": ["langgraph", "worker"],
    "hosts.py": ["cli", "leasing", "ops"],
    "keys.py": ["cli", "ops"],
    "keyspace.py": ["langgraph", "leasing"],
    "ledger.py": ["leasing", "tools"],
    "replies.py": ["langgraph", "leasing"],
    "retention.py": ["cli", "leasing", "ops"],
    "scripts.py": ["langgraph", "leasing"],
}


def test_the_product_packages_repeat_only_the_file_names_kept_on_purpose() -> None:
    packages: defaultdict[str, list[str]] = defaultdict(list)
    for package in PRODUCT:
        for path in (SRC / package).rglob("*.py"):
            if path.name not in ("__init__.py", "__main__.py"):
                packages[path.name].append(package)
    repeated = {name: sorted(where) for name, where in packages.items() if len(where) > 1}
    assert repeated == KEPT


def test_the_architecture_page_lists_every_kept_name() -> None:
    page = (SRC.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    for name in KEPT:
        assert f"| `{name}` |" in page, name
