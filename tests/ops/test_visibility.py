"""What went wrong, visible: ``ratchet show`` (text and --json), the console's run and
workers pages and the metrics show a run's status and owner, its job errors, a failed
verifier's scrubbed output, takeovers in its timeline, and its pending write as a diff.

Real redis-server processes throughout; real worker processes where a worker's own view
(its registry entry, its heartbeat, its metrics endpoint, a SIGKILL) is the point.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from ratchet.cli.console import fleet_console_data
from ratchet.cli.render import run_to_json
from ratchet.console import serve_console
from ratchet.console.pages import run_page, workers_page
from ratchet.demo.examples import RIGHT_GREETING, greeting_document, make_greeting_workspace
from ratchet.fleet import metrics
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import VerifierSpec
from ratchet.fleet.scrub import REDACTED, Scrubber, tail
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run, submit
from ratchet.ops.changes import DIFF_SHOW_BYTES, SHOW_BYTES
from ratchet.ops.queueview import list_workers, owner_of_worker
from ratchet.redis_server import RedisServer
from ratchet.worker.job import execute_run
from tests.ops.browser import browser, fetch, screenshot
from tests.ops.helpers import MakeWorkspace, free_block, poll, run_awaiting_approval, scrape
from tests.worker.conftest import CHECKPOINT_KEY_HEX
from tests.worker.fleet_harness import holder_pid, phase, workers

FAKE_TOKEN = "ghp_" + "A1b2C3d4E5" * 4
FAKE_PASSWORD = "hunter2-hunter2"


def show(redis_server: RedisServer, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``ratchet show ...`` in a child process, configured only through its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_REDIS_URL=redis_server.url, RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX, COLUMNS="200"
    )
    done = subprocess.run(
        [sys.executable, "-m", "ratchet.cli.entry", "show", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def detail(fleet: Fleet, run_id: str) -> dict[str, Any]:
    return run_to_json(inspect_run(fleet, run_id), 0, fleet=fleet)


def allowing_probes(fleet: Fleet, **update: Any) -> Fleet:
    return Fleet.connect(fleet.settings.model_copy(update={"agents": ("tests.worker",), **update}))


# --- scrubbing ---------------------------------------------------------------------------------


def test_the_scrubber_replaces_configured_secrets_and_token_shapes() -> None:
    key = "ab" * 32
    scrubber = Scrubber([key, "short"])
    text = (
        f"key {key.upper()} token {FAKE_TOKEN} Authorization: Bearer abcdefgh12345678\n"
        f"password={FAKE_PASSWORD} url redis://user:s3cretpass@host:6379/0 "
        "AKIAABCDEFGHIJKLMNOP kept: short hello\n"
        "-----BEGIN PRIVATE KEY-----\nMIIEv\n-----END PRIVATE KEY-----\n"
        f"cut here {key[:20]}"
    )
    clean = scrubber.scrub(text)
    for secret in (
        key,
        key.upper(),
        FAKE_TOKEN,
        "abcdefgh12345678",
        FAKE_PASSWORD,
        "s3cretpass",
        "AKIAABCDEFGHIJKLMNOP",
        "MIIEv",
        key[:20],
    ):
        assert secret not in clean, secret
    assert "kept: short hello" in clean  # too short to be treated as a secret
    assert clean.count(REDACTED) >= 8 and clean.endswith(REDACTED)
    assert "password=" in clean and "redis://user:" in clean  # names stay, values go
    assert key not in repr(scrubber) and key.upper() not in repr(scrubber)


def test_the_scrubber_knows_the_settings_secrets_and_ratchet_secret_variables(
    settings: Settings,
) -> None:
    scrubber = Scrubber.from_settings(
        settings,
        environ={
            "RATCHET_HTTP_TOKEN": "tok-" + "9" * 20,
            "RATCHET_LOG_LEVEL": "WARNING-LEVEL",
            "OTHER_TOKEN": "not-ours-123456",
        },
    )
    clean = scrubber.scrub(f"{CHECKPOINT_KEY_HEX} tok-{'9' * 20} WARNING-LEVEL not-ours-123456")
    assert CHECKPOINT_KEY_HEX not in clean and "9" * 20 not in clean
    assert "WARNING-LEVEL" in clean and "not-ours-123456" in clean


def test_a_tail_keeps_the_last_lines_within_the_byte_bound() -> None:
    text = "".join(f"line {i}\n" for i in range(100))
    kept, cut = tail(text, max_lines=40, max_bytes=4096)
    assert cut and kept.splitlines()[0] == "line 60" and kept.endswith("line 99\n")
    kept, cut = tail("é" * 5000, max_lines=40, max_bytes=101)
    assert cut and len(kept.encode()) <= 101 and set(kept) == {"é"}
    assert tail("short\n") == ("short\n", False)


# --- status ----------------------------------------------------------------------------------


def test_status_says_queued_then_leased_with_the_owner_and_the_stores_expiry(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    _root, document = workspace()
    run_id = submit(fleet, document)  # created and enqueued; no worker runs here
    status = detail(fleet, run_id)["status"]
    assert status["state"] == "queued" and status["queue_position"] == 1
    assert status["queue_depth"] >= 1 and status["owner"] is None
    got = fleet.store.try_acquire(run_id, owner="w-visible-1", ttl_ms=60_000)
    status = detail(fleet, run_id)["status"]
    assert status["state"] == "leased" and status["owner"] == "w-visible-1"
    assert status["lease_version"] == got.lease_version
    assert 0 < status["expires_in_ms"] <= 60_000
    assert "no worker reports running" in status["summary"]


def test_a_run_on_a_real_worker_shows_as_running_on_it_and_the_workers_page_lists_it(
    fleet: Fleet, settings: Settings, tmp_path: Path
) -> None:
    root = make_greeting_workspace(tmp_path / "ws-thinking")
    run_id = submit(fleet, greeting_document(root, agent_config={"think_ms": 400}, runner="python"))
    with workers(settings) as pool:
        pool.start(1)
        seen: dict[str, Any] = {}

        def running() -> bool:
            status = detail(fleet, run_id)["status"]
            info = list_workers(fleet)
            seen.update(status=status, info=info)
            return status["state"] == "running" and any(
                w["current_run"] == run_id for w in info["workers"]
            )

        poll(running, deadline_s=60, what="the run shown running on the worker")
        status, info = seen["status"], seen["info"]
        assert owner_of_worker(status["worker"]) == status["owner"]
        assert f"running on {status['worker']}" in status["summary"]
        (row,) = info["workers"]
        assert row["name"] == status["worker"] and row["owner"] == status["owner"]
        assert row["state"] == "busy" and row["current_job"]
        assert row["heartbeat_age_s"] is not None and row["heartbeat_age_s"] >= 0
        page = workers_page(info)
        assert status["worker"] in page and f"/runs/{run_id}" in page
        assert "<script" not in page


# --- a poisoned run --------------------------------------------------------------------------


def test_a_poisoned_run_shows_its_job_error_in_show_the_console_and_the_metrics(
    fleet: Fleet, settings: Settings, redis_server: RedisServer, tmp_path: Path
) -> None:
    poisoning = allowing_probes(fleet, max_job_errors=1)
    base = free_block(1)
    with workers(poisoning.settings) as pool:
        pool.start(1, env={"RATCHET_METRICS_PORT": str(base)})
        scraped: dict[str, float] = {}

        def serving() -> bool:
            scraped.update(scrape(base) or {})
            return bool(scraped)

        poll(serving, deadline_s=60, what="the worker serving metrics")
        # Every labelled series is there from the start, at zero: an alert on the first
        # increase can fire.
        assert scraped["ratchet_job_errors_total|error=TypeError"] == 0.0
        assert scraped["ratchet_job_errors_total|error=other"] == 0.0
        assert scraped["ratchet_jobs_total|outcome=poisoned|phase=unknown"] == 0.0
        assert scraped["ratchet_leases_lost_total|reason=stalled"] == 0.0
        assert scraped["ratchet_run_duration_seconds_count|phase=completed"] == 0.0
        root = make_greeting_workspace(tmp_path / "ws-poison")
        run_id = submit(
            poisoning,
            greeting_document(root).model_copy(update={"agent": "tests.worker.agent_probe:broken"}),
        )

        def counted() -> bool:
            # The job error is counted while the job fails, its outcome when it has
            # ended: a scrape can fall between the two, so wait for both.
            scraped.update(scrape(base) or {})
            return (
                scraped.get("ratchet_job_errors_total|error=TypeError") == 1.0
                and scraped.get("ratchet_jobs_total|outcome=poisoned|phase=unknown") == 1.0
            )

        poll(counted, deadline_s=60, what="the job error and its outcome counted on the worker")
        assert scraped["ratchet_job_errors_total|error=other"] == 0.0

    data = detail(poisoning, run_id)
    error = data["last_job_error"]
    assert error["error"] == "TypeError" and error["message"] == "this agent is broken"
    assert "agent_probe.py" in error["where"] and error["attempt"] == 1
    assert error["next"].startswith("frozen")
    assert data["status"]["state"] == "idle" and data["status"]["frozen"]
    assert "ratchet retry" in data["status"]["why"]
    assert data["current_incident"]["kind"] == "job_error"
    timeline = [(i["source"], i.get("seq"), i["what"]) for i in data["timeline"]]
    started = timeline.index(("trace", 1, "started"))
    error_at = next(
        n
        for n, (source, _, what) in enumerate(timeline)
        if source == "incident" and what.startswith("job error TypeError")
    )
    assert started < error_at  # the job's error after the run's start, though both are
    #                            stamped within the same second or two

    text = show(redis_server, tmp_path, run_id).stdout
    assert "last job error" in text and "TypeError" in text and "frozen" in text
    assert "this agent is broken" in text
    shown = json.loads(show(redis_server, tmp_path, run_id, "--json").stdout)
    assert shown["last_job_error"]["error"] == "TypeError"
    assert shown["status"]["frozen"] is True

    page = run_page(data, now=0)
    assert "Last job error" in page and "TypeError" in page and "badge state-frozen" in page
    # Where the run lives: its host (the submitter's, signed), alive while the pool ran,
    # and each part of its environment.
    host = poisoning.settings.host
    assert data["status"]["host"] == host and data["status"]["moved"] is None
    assert data["status"]["environment_parts"] == {"workspace": "host-local"}
    assert f"{host} (alive)" in page and "workspace: host-local" in page
    assert f"{host} (alive)" in text


# --- a failed verifier -----------------------------------------------------------------------


def test_a_failed_verifier_shows_its_tail_with_secrets_scrubbed_and_marked_unsigned(
    fleet: Fleet, redis_server: RedisServer, tmp_path: Path
) -> None:
    root = make_greeting_workspace(tmp_path / "ws-verify")
    script = (
        "import sys\n"
        "for i in range(80): print(f'progress {i}')\n"
        f"print('leaked key {CHECKPOINT_KEY_HEX} token {FAKE_TOKEN}')\n"
        f"print('password={FAKE_PASSWORD}')\n"
        "print('FAILED test_app.py::test_greeting - the last line')\n"
        "sys.exit(3)\n"
    )
    base = greeting_document(root)
    environment = base.environment.model_copy(
        update={
            "verifiers": {
                "unit": VerifierSpec(argv=(sys.executable, "-c", script), timeout_seconds=60)
            }
        }
    )
    document = base.model_copy(
        update={
            "agent": "scripted",
            "environment": environment,
            "agent_config": {"steps": [{"kind": "run_verifier", "args": {"target": "unit"}}]},
        }
    )
    run_id = submit(fleet, document)
    report = execute_run(fleet, run_id, owner="w-verify")
    assert report.outcome == "no_proposal", report

    data = detail(fleet, run_id)
    output = data["verifier_output"]
    assert output["exit_code"] == 3 and output["target"] == "unit"
    assert output["message"] == "the verifier exited with 3"
    assert "unsigned" in output["label"]
    assert output["binding"] == "its digest is the run's latest signed verifier report"
    assert output["output_digest"] == inspect_run(fleet, run_id).state.verification.output_digest  # type: ignore[union-attr]
    tail_text = output["tail"]
    assert tail_text.rstrip().endswith("the last line") and output["tail_cut"] is True
    assert len(tail_text.splitlines()) <= 40 and len(tail_text.encode()) <= 4096
    assert "progress 0\n" not in tail_text and "progress 79" in tail_text
    assert REDACTED in tail_text
    everything = (
        json.dumps(data)
        + show(redis_server, tmp_path, run_id).stdout
        + show(redis_server, tmp_path, run_id, "--json").stdout
        + run_page(data, now=0)
    )
    for secret in (CHECKPOINT_KEY_HEX, FAKE_TOKEN, FAKE_PASSWORD):
        assert secret not in everything, secret
    stored = json.dumps(fleet.store.records.incidents(run_id))  # scrubbed before it was kept
    assert CHECKPOINT_KEY_HEX not in stored and FAKE_TOKEN not in stored
    assert "the last line" in show(redis_server, tmp_path, run_id).stdout
    page = run_page(data, now=0)
    assert "Verifier output" in page and "unsigned, for diagnosis" in page


# --- a takeover ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_takeover_after_a_sigkill_shows_in_the_timeline(
    fleet: Fleet, settings: Settings, tmp_path: Path
) -> None:
    root = make_greeting_workspace(tmp_path / "ws-takeover")
    run_id = submit(fleet, greeting_document(root, agent_config={"think_ms": 150}, runner="python"))
    with workers(settings) as pool:
        procs = pool.start(2)
        pids = {p.pid for p in procs}
        killed: list[str] = []

        def kill_the_holder_mid_run() -> bool:
            pid = holder_pid(fleet, run_id)
            if pid is not None and pid in pids and fleet.store.read_run(run_id).generation >= 3:
                killed.append(str(fleet.store.read_run(run_id).owner))
                os.kill(pid, signal.SIGKILL)
                return True
            return False

        poll(kill_the_holder_mid_run, deadline_s=60, what="a worker holding the run mid-run")
        poll(
            lambda: phase(fleet, run_id) == "completed",
            deadline_s=120,
            what="the run completed by the other worker",
        )
        # The completing job releases the lease right after its last commit.
        poll(
            lambda: not fleet.store.read_run(run_id).lease_live,
            deadline_s=60,
            what="the lease released after the run completed",
        )
    data = detail(fleet, run_id)
    lease_items = [i for i in data["timeline"] if i["source"] == "lease"]
    taken = [i for i in lease_items if "taken over" in i["what"]]
    # One takeover from the killed worker (a loaded machine may add a later one).
    assert taken, lease_items
    assert taken[0]["what"] == f"taken over from {killed[0]} after lease expiry"
    assert taken[0]["owner"] != killed[0]
    assert not any(
        i["source"] == "incident" and i.get("kind") == "lease_taken_over" for i in data["timeline"]
    )  # shown once, as the lease change
    seqs = [i["seq"] for i in data["timeline"] if i["source"] == "trace"]
    assert seqs == sorted(seqs) and seqs[-1] == len(inspect_run(fleet, run_id).state.trace)
    assert data["status"]["state"] == "idle" and "completed" in data["status"]["why"]
    page = run_page(data, now=0)
    assert f"taken over from {killed[0]} after lease expiry" in page


# --- a pending write -------------------------------------------------------------------------


def test_a_pending_write_shows_its_content_and_a_diff_against_the_current_file(
    fleet: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path
) -> None:
    run_id = run_awaiting_approval(fleet, workspace, "r-visible-diff")
    data = detail(fleet, run_id)
    change = data["pending_change"]
    assert change["path"] == "app.py" and change["operation"] == "write_file"
    assert change["content"]["form"] == "text" and change["content"]["text"] == RIGHT_GREETING
    assert '-print("Hello, wrold")\n' in change["diff"]
    assert '+print("Hello, world")\n' in change["diff"]
    assert change["diff"].startswith("--- a/app.py (current)\n+++ b/app.py (pending)\n")
    assert change["scrubbed"] is False
    assert "waiting for a signed approval" in data["status"]["why"]
    text = show(redis_server, tmp_path, run_id).stdout
    assert '+print("Hello, world")' in text and '-print("Hello, wrold")' in text
    shown = json.loads(show(redis_server, tmp_path, run_id, "--json").stdout)
    assert shown["pending_change"]["diff"] == change["diff"]
    page = run_page(data, now=0)
    assert '<span class="add">+print(&quot;Hello, world&quot;)</span>' in page
    assert '<span class="del">-print(&quot;Hello, wrold&quot;)</span>' in page


def test_a_pending_write_through_a_link_or_of_huge_content_is_marked_not_printed(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    root, document = workspace(approval_required=("write_file",))
    huge = "x" * max(SHOW_BYTES + 1, DIFF_SHOW_BYTES * 2) + "\n"
    plan = [{"kind": "write_file", "args": {"path": "app.py", "content": huge}}]
    run_id = submit(
        fleet, document.model_copy(update={"agent": "scripted", "agent_config": {"steps": plan}})
    )
    assert execute_run(fleet, run_id, owner="w-huge").phase == "awaiting_approval"
    change = detail(fleet, run_id)["pending_change"]
    assert change["content"]["form"] == "huge" and "text" not in change["content"]
    assert change["content"]["bytes"] == len(huge)
    assert len(change["diff"].encode()) <= DIFF_SHOW_BYTES + 200
    assert "not shown" in change["diff_note"]
    outside = tmp_path / "outside.py"
    outside.write_text("secret = 1\n")
    (root / "app.py").unlink()
    (root / "app.py").symlink_to(outside)
    change = detail(fleet, run_id)["pending_change"]
    assert change["current"] is None and change["diff"] is None
    assert change["current_note"] == "the path goes through a symbolic link"


# --- metrics -----------------------------------------------------------------------------------


def test_a_completed_run_observes_its_duration_by_the_stores_clock(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    def count() -> float:
        return (
            REGISTRY.get_sample_value("ratchet_run_duration_seconds_count", {"phase": "completed"})
            or 0.0
        )

    assert (
        REGISTRY.get_sample_value("ratchet_run_duration_seconds_count", {"phase": "failed"})
        is not None
    )  # there at zero
    before = count()
    _root, document = workspace()
    run_id = submit(fleet, document)
    assert execute_run(fleet, run_id, owner="w-duration").phase == "completed"
    assert count() == before + 1
    assert metrics.error_label(type("PlanError", (ValueError,), {})()) == "ValueError"
    assert metrics.error_label(type("Odd", (Exception,), {})()) == "other"


def test_the_console_serves_queue_depth_workers_and_the_oldest_approval_age(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    run_awaiting_approval(fleet, workspace, "r-visible-age")
    _root, document = workspace()
    submit(fleet, document)  # one job waits in the queue
    server = serve_console(fleet_console_data(fleet), port=0, background=True)
    try:
        status, _, text = fetch(server, "/metrics")
        assert status == 200
        values = {
            s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert values["ratchet_queue_depth"] == 2.0  # both runs were enqueued
        assert values["ratchet_workers|state=busy"] == 0.0  # no worker: at zero, present
        assert values["ratchet_oldest_approval_age_seconds"] >= 0.0
        status, _, page = fetch(server, "/workers")
        assert status == 200 and "no worker is registered" in page
        assert "<strong>2</strong> jobs waiting" in page and 'href="/workers"' in page
    finally:
        server.shutdown()
        server.server_close()


# --- in a real browser ---------------------------------------------------------------------


@pytest.mark.slow
def test_the_run_page_and_the_workers_page_in_chromium(
    fleet: Fleet, settings: Settings, workspace: MakeWorkspace, tmp_path: Path, record_property: Any
) -> None:
    from selenium.webdriver.common.by import By

    server = serve_console(fleet_console_data(fleet), port=0, background=True)
    driver = browser(tmp_path / "chromium-profile")
    try:
        with workers(settings) as pool:
            pool.start(1)
            poll(
                lambda: [w["state"] for w in list_workers(fleet)["workers"]] == ["idle"],
                deadline_s=60,
                what="the worker registered and idle",
            )
            driver.get(f"{server.url}/workers")
            body = driver.find_element(By.TAG_NAME, "body").text
            (worker,) = list_workers(fleet)["workers"]
            assert worker["name"] in body and str(worker["owner"]) in body
            assert "idle" in body and "0 jobs waiting" in body
            assert not driver.find_elements(By.TAG_NAME, "script")
            screenshot(driver, tmp_path / "console-workers.png", record_property)

        # The worker is gone: nothing picks up the jobs these runs leave in the queue.
        pending_id = run_awaiting_approval(fleet, workspace, "r-visible-browser")
        poisoning = allowing_probes(fleet, max_job_errors=1)
        root = make_greeting_workspace(tmp_path / "ws-browser-poison")
        poisoned_id = submit(
            poisoning,
            greeting_document(root).model_copy(update={"agent": "tests.worker.agent_probe:broken"}),
        )
        assert execute_run(poisoning, poisoned_id, owner="w-browser").outcome == "poisoned"
        driver.get(f"{server.url}/runs/{pending_id}")
        body = driver.find_element(By.TAG_NAME, "body").text
        assert "Status" in body and "waiting for a signed approval" in body
        assert "Pending change" in body and '+print("Hello, world")' in body
        added = driver.find_element(By.CSS_SELECTOR, "pre.diff span.add")
        assert added.value_of_css_property("background-color") != "rgba(0, 0, 0, 0)"
        screenshot(driver, tmp_path / "console-run-pending-diff.png", record_property)

        driver.get(f"{server.url}/runs/{poisoned_id}")
        body = driver.find_element(By.TAG_NAME, "body").text
        assert "Last job error" in body and "TypeError" in body and "frozen" in body
        assert "Timeline" in body and "job error TypeError" in body
        screenshot(driver, tmp_path / "console-run-poisoned.png", record_property)
        assert (
            driver.find_element(By.LINK_TEXT, "workers").get_attribute("href").endswith("/workers")
        )
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()
