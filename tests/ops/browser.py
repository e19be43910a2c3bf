"""The console's pages in a real browser: Debian's headless Chromium through selenium
(never downloaded), screenshots kept as CI artifacts, and a plain HTTP fetch."""

from __future__ import annotations

import http.client
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from ratchet.console import ConsoleServer

CHROMIUM = os.environ.get("RATCHET_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("RATCHET_CHROMEDRIVER", "/usr/bin/chromedriver")
# rebind.test resolves to 127.0.0.1 inside the browser: a DNS-rebinding page's view.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,2200",
    "--host-resolver-rules=MAP rebind.test 127.0.0.1",
)


def fetch(
    server: ConsoleServer, path: str, method: str = "GET", *, host_header: str | None = None
) -> tuple[int, dict[str, str], str]:
    host, port = str(server.server_address[0]), int(server.server_address[1])
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        headers = {"Host": host_header} if host_header is not None else {}
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        return (
            response.status,
            {k.lower(): v for k, v in response.getheaders()},
            response.read().decode(),
        )
    finally:
        conn.close()


def browser(profile: Path) -> Any:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        if os.environ.get("RATCHET_REQUIRE_BROWSER") == "1":  # CI installs it: never skip
            pytest.fail(f"chromium / chromedriver missing at {CHROMIUM}, {CHROMEDRIVER}")
        pytest.skip(
            f"headless browser test needs Debian's chromium and chromium-driver "
            f"({CHROMIUM}, {CHROMEDRIVER}); apt-get install chromium chromium-driver"
        )
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="the browser test needs selenium (test extra)"
    )
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def screenshot(driver: Any, path: Path, record_property: Any) -> Path:
    assert driver.save_screenshot(str(path)), f"screenshot {path} not written"
    copy_to = os.environ.get("RATCHET_SCREENSHOT_DIR")
    if copy_to:
        Path(copy_to).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(copy_to) / path.name)
    record_property(f"screenshot:{path.name}", str(path))
    print(f"screenshot: {path}")
    return path
