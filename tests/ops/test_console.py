"""The read-only web console: HTTP behaviour, escaping, filters, and the pages in Chromium."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ratchet.cli.console import fleet_console_data
from ratchet.console import CSP, ConsoleData, ConsoleServer, serve_console
from ratchet.console.pages import run_page
from ratchet.fleet.context import Fleet
from ratchet.runtime import ApprovalClaims, sign_approval
from tests.ops.browser import browser, fetch, screenshot
from tests.ops.helpers import MakeWorkspace, run_awaiting_approval, run_in_review

pytestmark = pytest.mark.slow


@pytest.fixture
def console(fleet: Fleet, workspace: MakeWorkspace) -> Iterator[tuple[ConsoleServer, str, str]]:
    review_id = run_in_review(fleet, workspace, "r-console-review")
    approval_id = run_awaiting_approval(fleet, workspace, "r-console-approve")
    server = serve_console(fleet_console_data(fleet), port=0, background=True)
    try:
        yield server, review_id, approval_id
    finally:
        server.shutdown()
        server.server_close()


def test_the_console_listens_on_loopback_and_serves_pages_with_a_strict_csp(
    console: tuple[ConsoleServer, str, str],
) -> None:
    server, review_id, _ = console
    assert server.server_address[0] == "127.0.0.1"
    status, headers, body = fetch(server, "/runs")
    assert status == 200
    assert headers["content-security-policy"] == CSP
    assert "script-src" not in CSP and "default-src 'none'" in CSP
    assert headers["x-frame-options"] == "DENY"
    assert review_id in body and "<script" not in body


@pytest.mark.parametrize(
    "host",
    ["evil.example", "rebind.test:{port}", "127.0.0.2:{port}", "localhost:1", "localhost", ""],
)
def test_the_console_answers_only_its_own_origin(
    console: tuple[ConsoleServer, str, str], host: str
) -> None:
    server, review_id, _ = console
    header = host.format(port=server.server_address[1])
    for path in (f"/runs/{review_id}", "/reviews", "/metrics", "/runs"):
        status, _, body = fetch(server, path, host_header=header)
        assert status == 421, (path, header)
        assert review_id not in body and "case-" not in body


def test_a_request_without_a_host_header_is_refused(
    console: tuple[ConsoleServer, str, str],
) -> None:
    import socket

    server, review_id, _ = console
    with socket.create_connection(server.server_address[:2], timeout=30) as sock:
        sock.sendall(f"GET /runs/{review_id} HTTP/1.0\r\n\r\n".encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.0 421") and review_id.encode() not in reply


@pytest.mark.parametrize("host", ["localhost:{port}", "127.0.0.1:{port}", "LOCALHOST:{port}"])
def test_the_console_answers_its_own_names(
    console: tuple[ConsoleServer, str, str], host: str
) -> None:
    server, review_id, _ = console
    status, _, body = fetch(
        server, f"/runs/{review_id}", host_header=host.format(port=server.server_address[1])
    )
    assert status == 200 and review_id in body


def test_a_reverse_proxys_name_is_answered_once_allowed(fleet: Fleet) -> None:
    server = serve_console(
        fleet_console_data(fleet),
        port=0,
        background=True,
        allowed_hosts=["console.internal.example"],
    )
    try:
        assert fetch(server, "/healthz", host_header="console.internal.example")[0] == 200
        assert fetch(server, "/healthz", host_header="other.example")[0] == 421
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
def test_the_console_has_no_write_endpoint(
    console: tuple[ConsoleServer, str, str], method: str
) -> None:
    server, review_id, _ = console
    status, headers, _ = fetch(server, f"/runs/{review_id}", method)
    assert status == 405
    assert headers["allow"] == "GET, HEAD"


def test_the_runs_list_filters_by_phase_and_owner(console: tuple[ConsoleServer, str, str]) -> None:
    server, review_id, approval_id = console
    _, _, body = fetch(server, "/runs?phase=needs_review")
    assert review_id in body and approval_id not in body
    _, _, body = fetch(server, "/runs?owner=nobody-holds-this")
    assert review_id not in body and approval_id not in body
    _, _, body = fetch(server, "/runs?phase=%3Cscript%3E")
    assert "<script>" not in body and "unknown phase" in body


def test_a_missing_run_is_a_404_and_a_hostile_id_is_never_echoed_raw(
    console: tuple[ConsoleServer, str, str],
) -> None:
    server, _, _ = console
    status, _, body = fetch(server, "/runs/r-no-such-run")
    assert status == 404 and "no such run" in body
    status, _, body = fetch(server, "/runs/%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E")
    assert status == 409 and "not a valid id" in body
    assert "<img" not in body
    status, _, body = fetch(server, "/%3Cb%3Enowhere")
    assert status == 404 and "<b>" not in body and "&lt;b&gt;" in body


def test_the_console_serves_fleet_gauges_for_prometheus(
    console: tuple[ConsoleServer, str, str],
) -> None:
    server, _, _ = console
    _, _, text = fetch(server, "/metrics")
    assert 'ratchet_runs{phase="needs_review"} 1.0' in text
    assert "ratchet_approvals_waiting 1.0" in text
    assert "ratchet_reviews_waiting 1.0" in text


def test_expired_approval_evidence_stays_visible_and_is_marked(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    run_id = run_awaiting_approval(fleet, workspace, "r-console-expired")
    data = fleet_console_data(fleet)
    run = data.run_detail(run_id, data.now())
    pending = run["pending"]
    claims = ApprovalClaims(
        task_id=run["task"]["task_id"],
        run_id=run_id,
        policy_id=run["task"]["policy_id"],
        policy_version=run["task"]["policy_version"],
        action_id=pending["action"]["action_id"],
        idempotency_key=pending["action"]["idempotency_key"],
        intent_digest=pending["intent_digest"],
        env_instance_id=run["environment"]["instance_id"],
        env_fingerprint=run["environment"]["fingerprint"],
        env_version=run["environment"]["version"],
        generation=run["generation"],
        nonce="ap-expired-1",
        expires_at=data.now() - 120,
        max_proposals=50,
    )
    evidence = sign_approval(Ed25519PrivateKey.generate(), "alice", claims)
    pending["approval"] = evidence.model_dump(mode="json")
    page = run_page(run, now=data.now())
    assert "EXPIRED" in page and 'class="badge expired"' in page
    assert "alice" in page and claims.nonce in page


# --- the pages in a real browser ------------------------------------------------------------


def test_the_run_page_and_the_review_queue_show_the_evidence_in_chromium(
    console: tuple[ConsoleServer, str, str], fleet: Fleet, tmp_path: Path, record_property: Any
) -> None:
    from selenium.webdriver.common.by import By

    server, review_id, approval_id = console
    driver = browser(tmp_path / "chromium-profile")
    data: ConsoleData = server.data
    review = data.run_detail(review_id, data.now())["review"]
    pending = data.run_detail(approval_id, data.now())["pending"]
    try:
        driver.get(f"{server.url}/runs/{review_id}")
        text = driver.find_element(By.TAG_NAME, "body").text
        assert "needs_review" in text and review["case_id"] in text
        assert review["pending"]["intent_digest"] in text  # both digests
        assert review["receipt"]["intent_digest"] in text
        assert review["receipt_fingerprint"] in text  # the receipt and its fingerprint
        assert f"ratchet review {review_id} --decision replan --key REVIEWER_KEY.pem" in text
        assert "Timeline" in text and "review_opened" in text
        css = driver.find_element(By.TAG_NAME, "header").value_of_css_property("background-color")
        assert css != "rgba(0, 0, 0, 0)", "the style sheet loaded under the CSP"
        screenshot(driver, tmp_path / "console-run-needs-review.png", record_property)

        driver.get(f"{server.url}/reviews")
        text = driver.find_element(By.TAG_NAME, "body").text
        assert review_id in text and approval_id in text and review["case_id"] in text
        assert f"ratchet approve {approval_id} {pending['action']['action_id']}" in text
        screenshot(driver, tmp_path / "console-review-queue.png", record_property)

        driver.get(f"{server.url}/runs/{approval_id}")
        text = driver.find_element(By.TAG_NAME, "body").text
        assert "awaiting_approval" in text and pending["intent_digest"] in text
        screenshot(driver, tmp_path / "console-run-awaiting-approval.png", record_property)

        driver.get(f"{server.url}/runs?phase=needs_review")
        rows = driver.find_elements(By.CSS_SELECTOR, "table tr")
        assert len(rows) == 2 and review_id in rows[1].text
        assert not driver.find_elements(By.TAG_NAME, "script")

        # A page on another name that resolves to the console's address (DNS rebinding)
        # gets nothing of any run.
        driver.get(f"http://rebind.test:{server.server_address[1]}/runs/{review_id}")
        text = driver.find_element(By.TAG_NAME, "body").text
        assert "answers only its own address" in text
        assert review["case_id"] not in text and review_id not in text
    finally:
        driver.quit()
    with urllib.request.urlopen(f"{server.url}/healthz", timeout=10) as response:
        assert response.read() == b"ok\n"


def loaded(driver: Any, url_part: str) -> bool:
    """The page navigated to (its URL has ``url_part``) has finished loading."""
    return url_part in driver.current_url and (
        driver.execute_script("return document.readyState") == "complete"
    )


def test_the_runs_list_pages_and_searches_in_chromium(
    console: tuple[ConsoleServer, str, str], fleet: Fleet, tmp_path: Path, record_property: Any
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server, review_id, approval_id = console
    listed = [f"r-list-{i:02d}" for i in range(7)]
    for run_id in listed:  # the list never opens a checkpoint: opaque ones do
        fleet.store.create_run(
            run_id, task_id="task-list", env_instance_id="e", scenario=b"s", checkpoint=b"g1"
        )
    driver = browser(tmp_path / "chromium-profile")
    try:
        driver.get(f"{server.url}/runs?limit=3")
        counts = driver.find_element(By.CSS_SELECTOR, "nav.counts").text
        assert "all 9" in counts and "needs_review 1" in counts
        assert "awaiting_approval 1" in counts and "running 7" in counts
        rows = driver.find_elements(By.CSS_SELECTOR, "table tr")
        assert [r.text.split()[0] for r in rows[1:]] == listed[:-4:-1]
        driver.find_element(By.LINK_TEXT, "next page →").click()
        WebDriverWait(driver, 20).until(lambda d: loaded(d, "after="))
        rows = driver.find_elements(By.CSS_SELECTOR, "table tr")
        assert [r.text.split()[0] for r in rows[1:]] == listed[3::-1][:3]
        assert "after=" in driver.current_url

        driver.get(f"{server.url}/runs?limit=2")
        box = driver.find_element(By.NAME, "q")
        box.send_keys("r-list-0")
        box.submit()
        # submit() returns before the new page has loaded: wait for it (bounded).
        WebDriverWait(driver, 20).until(lambda d: loaded(d, "q=r-list-0"))
        rows = driver.find_elements(By.CSS_SELECTOR, "table tr")
        assert [r.text.split()[0] for r in rows[1:]] == ["r-list-06", "r-list-05"]
        text = driver.find_element(By.TAG_NAME, "body").text
        assert "matching" in text and review_id not in text and approval_id not in text
        assert driver.find_elements(By.LINK_TEXT, "continue searching →")
        assert not driver.find_elements(By.TAG_NAME, "script")
        screenshot(driver, tmp_path / "console-runs-search-pages.png", record_property)

        driver.get(f"{server.url}/runs?q={review_id}")  # a run id goes straight to it
        assert driver.current_url.endswith(f"/runs/{review_id}")
    finally:
        driver.quit()
