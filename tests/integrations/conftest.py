"""Fixtures for the integrations' tests: the worker tests' real redis-server and settings,
agents allowed from this package, the shop's folder, and the shop's tools installed the
way pip leaves a package (a dist-info with ``ratchet.tools`` entry points)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from tests.worker.conftest import redis_server, settings

__all__ = ["installed_shop", "pai_fleet", "pai_settings", "redis_server", "settings", "shop_dir"]

ENTRY_POINTS = """[ratchet.tools]
create_refund = tests.integrations.shop:create_refund_tool
order_status = tests.integrations.shop:order_status_tool
close_account = tests.integrations.shop:close_account_tool
cancel_order = tests.integrations.shop:cancel_order_tool
"""


@pytest.fixture
def shop_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The payments service's folder, named to every process started from now on."""
    folder = tmp_path / "shop"
    folder.mkdir()
    monkeypatch.setenv("PAI_SHOP_DIR", str(folder))
    return folder


@pytest.fixture
def installed_shop(tmp_path: Path) -> Iterator[Path]:
    """The shop's tools installed under ``ratchet.tools`` (worker processes started
    while this is on the import path inherit it)."""
    site = tmp_path / "site"
    info = site / "pai_shop_tools-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pai-shop-tools\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        importlib.invalidate_caches()


@pytest.fixture
def pai_settings(settings: Settings, shop_dir: Path, installed_shop: Path) -> Settings:
    return settings.model_copy(update={"agents": ("tests.integrations",)})


@pytest.fixture
def pai_fleet(pai_settings: Settings) -> Fleet:
    return Fleet.connect(pai_settings)
