"""Fixtures for the integrations' tests: the worker tests' real redis-server and settings,
agents allowed from this package, the shop's folder, the shop's tools installed the way
pip leaves a package (a dist-info with ``ratchet.tools`` entry points), and the local
OpenAI-compatible model the Agents SDK shop talks to."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.testing.chat_stub import ChatStub
from tests.worker.conftest import redis_server, settings

__all__ = [
    "installed_oai_shop",
    "installed_shop",
    "oai_fleet",
    "oai_settings",
    "oai_stub",
    "pai_fleet",
    "pai_settings",
    "redis_server",
    "settings",
    "shop_dir",
]

ENTRY_POINTS = """[ratchet.tools]
create_refund = tests.integrations.shop:create_refund_tool
order_status = tests.integrations.shop:order_status_tool
close_account = tests.integrations.shop:close_account_tool
cancel_order = tests.integrations.shop:cancel_order_tool
"""

OAI_ENTRY_POINTS = """[ratchet.tools]
create_refund = tests.integrations.oai_shop:create_refund_tool
order_status = tests.integrations.oai_shop:order_status_tool
close_account = tests.integrations.oai_shop:close_account_tool
"""


@pytest.fixture
def shop_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The payments service's folder, named to every process started from now on."""
    folder = tmp_path / "shop"
    folder.mkdir()
    monkeypatch.setenv("PAI_SHOP_DIR", str(folder))
    return folder


def _installed(site: Path, name: str, entry_points: str) -> Iterator[Path]:
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        importlib.invalidate_caches()


@pytest.fixture
def installed_shop(tmp_path: Path) -> Iterator[Path]:
    """The shop's tools installed under ``ratchet.tools`` (worker processes started
    while this is on the import path inherit it)."""
    yield from _installed(tmp_path / "site", "pai-shop-tools", ENTRY_POINTS)


@pytest.fixture
def installed_oai_shop(tmp_path: Path) -> Iterator[Path]:
    """The Agents SDK shop's tools installed under ``ratchet.tools``."""
    yield from _installed(tmp_path / "oai-site", "oai-shop-tools", OAI_ENTRY_POINTS)


@pytest.fixture
def oai_stub(monkeypatch: pytest.MonkeyPatch) -> Iterator[ChatStub]:
    """The Agents SDK shop's model: a local OpenAI-compatible server playing
    ``oai_shop.shop_replies`` (every completion reports 40 prompt and 10 completion
    tokens), named to every process started from now on."""
    from tests.integrations.oai_shop import OAI_KEY, STUB_KEY_ENV, STUB_URL_ENV, shop_replies

    with ChatStub(shop_replies, api_key=OAI_KEY, usage=(40, 10)) as stub:
        monkeypatch.setenv(STUB_URL_ENV, stub.base_url)
        monkeypatch.setenv(STUB_KEY_ENV, OAI_KEY)
        yield stub


@pytest.fixture
def pai_settings(settings: Settings, shop_dir: Path, installed_shop: Path) -> Settings:
    return settings.model_copy(update={"agents": ("tests.integrations",)})


@pytest.fixture
def pai_fleet(pai_settings: Settings) -> Fleet:
    return Fleet.connect(pai_settings)


@pytest.fixture
def oai_settings(
    settings: Settings, shop_dir: Path, installed_oai_shop: Path, oai_stub: ChatStub
) -> Settings:
    return settings.model_copy(update={"agents": ("tests.integrations",)})


@pytest.fixture
def oai_fleet(oai_settings: Settings) -> Fleet:
    return Fleet.connect(oai_settings)
