"""The dashboard in a real headless browser (Debian's Chromium driven by Playwright).

Two keys train through the real SDK against a real server; the browser logs in with one key and
must see that key's run with the loss curve of exactly the steps trained (`loss:sum` per step, as
the SDK returned it), must not see the other key's run, and cannot open it by URL. Screenshots of
both pages are saved under the test's tmp dir (paths printed) as artifacts. An admin pages through
the audit log in the browser, filtered, and gets the entries the admin route gives, page for page.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from tinker import types

from helpers import BASE_MODEL, sft_batch
from server_process import ServerProcess

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Flags for a sandboxed CI machine with no display and no network.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ALICE, BOB, ROOT = "tml-dashboard-alice", "tml-dashboard-bob", "tml-dashboard-root"


def _train(server: ServerProcess, key: str, steps: int) -> tuple[str, list[float]]:
    with server.client(key) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        losses = []
        for step in range(steps):
            losses.append(tc.forward_backward(sft_batch(4, seed=step), "cross_entropy").result().metrics["loss:sum"])
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        tc.save_state("after-training", ttl_seconds=3600).result()
        return tc.model_id, losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"alice: {ALICE}\nbob: {BOB}\nroot: {ROOT}\n")
    srv = ServerProcess(tmp_path_factory.mktemp("dashboard"),
                        args=("--api-keys-file", str(keys), "--admin-users", "root")).start()
    try:
        alice_run, alice_losses = _train(srv, ALICE, 3)
        bob_run, _ = _train(srv, BOB, 1)
        yield srv, alice_run, alice_losses, bob_run
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed (apt-get install -y chromium; .ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def test_a_key_sees_its_runs_loss_curve_and_not_another_keys_runs(trained, browser, tmp_path):
    srv, alice_run, alice_losses, bob_run = trained
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(f"{srv.base_url}/dashboard")
    page.fill("#api_key", "tml-not-a-key")
    page.click("button[type=submit]")
    assert "not accepted" in page.text_content("[role=alert]")

    page.fill("#api_key", ALICE)
    page.click("button[type=submit]")
    page.wait_for_selector("#runs")
    runs = page.eval_on_selector_all("#runs tbody tr", "rows => rows.map(r => r.dataset.runId)")
    assert runs == [alice_run]  # bob's run is not listed
    assert bob_run not in page.content()
    assert f"tinker://{alice_run}/weights/after-training" in page.text_content("#checkpoints")
    assert "in 1.0 h" in page.text_content("#checkpoints")  # its TTL
    page.wait_for_function("window.cycleChart && window.cycleChart.data[0].length > 0")
    overview_shot = tmp_path / "dashboard-overview.png"
    page.screenshot(path=str(overview_shot), full_page=True)

    page.click(f"a[href='/dashboard/runs/{alice_run}']")
    page.wait_for_function("window.lossChart !== undefined")
    steps, losses = page.evaluate("[window.lossChart.data[0], window.lossChart.data[1]]")
    assert steps == [0, 1, 2]
    assert losses == pytest.approx(alice_losses, rel=1e-6)
    # The curve is drawn: the canvas has non-background pixels.
    assert page.evaluate("""() => { const c = document.querySelector('#loss-chart canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let i = 3; i < d.length; i += 4) if (d[i] !== 0) return true; return false; }""")
    run_shot = tmp_path / "dashboard-run.png"
    page.screenshot(path=str(run_shot), full_page=True)
    print(f"\nscreenshots: {overview_shot} {run_shot}")

    assert page.goto(f"{srv.base_url}/dashboard/runs/{bob_run}").status == 404
    page.close()


def test_dashboard_data_needs_a_key(trained):
    srv, alice_run, _, _ = trained
    assert httpx.get(f"{srv.base_url}/dashboard/api/cycles").status_code == 401
    assert httpx.get(f"{srv.base_url}/dashboard/api/runs/{alice_run}/loss",
                     headers={"X-API-Key": BOB}).status_code == 404
    answer = httpx.get(f"{srv.base_url}/dashboard/api/runs/{alice_run}/loss", headers={"X-API-Key": ALICE})
    assert [p["step"] for p in answer.json()["points"]] == [0, 1, 2]
    page = httpx.get(f"{srv.base_url}/dashboard")  # no key: the login form, not data
    assert page.status_code == 200 and 'name="api_key"' in page.text and alice_run not in page.text


def _route_pages(srv, **params) -> list[list[str]]:
    """The admin route's pages of `params`: each page's entries' checkpoint paths."""
    pages, query = [], params
    while True:
        answer = httpx.get(f"{srv.base_url}/api/v1/audit", params=query, headers={"X-API-Key": ROOT}, timeout=60).json()
        pages.append([e["tinker_path"] for e in answer["entries"]])
        if answer["next_cursor"] is None:
            return pages
        query = {"cursor": answer["next_cursor"], "limit": params["limit"]}


def _browser_pages(page) -> list[list[str]]:
    """The audit pages the browser shows from here on, following the next-page links."""
    pages = []
    while True:
        pages.append(page.eval_on_selector_all("#audit tbody tr td code", "cells => cells.map(c => c.textContent)"))
        if page.query_selector("#next-page") is None:
            assert page.query_selector("#last-page") is not None
            return pages
        page.click("#next-page")
        page.wait_for_selector("#audit-filters")


def test_an_admin_pages_the_audit_log_as_the_admin_route_gives_it(trained, browser, tmp_path):
    srv, alice_run, _, bob_run = trained
    assert httpx.get(f"{srv.base_url}/dashboard/audit", headers={"X-API-Key": ALICE}).status_code == 403
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(f"{srv.base_url}/dashboard")
    page.fill("#api_key", ROOT)
    page.click("button[type=submit]")
    page.click("#audit-link")
    page.wait_for_selector("#audit-filters")
    page.select_option("select[name=event]", "checkpoint_create")
    page.fill("input[name=limit]", "1")
    page.click("#audit-filters button[type=submit]")
    page.wait_for_selector("#audit")
    shown = _browser_pages(page)
    saved = [f"tinker://{alice_run}/weights/after-training", f"tinker://{bob_run}/weights/after-training"]
    assert shown == [[path] for path in saved]  # a page each, in the order they were saved
    assert shown == _route_pages(srv, event="checkpoint_create", limit=1)
    shot = tmp_path / "dashboard-audit.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"\nscreenshot: {shot}")

    page.goto(f"{srv.base_url}/dashboard/audit?user=bob&event=&limit=")  # empty fields: not given
    assert _browser_pages(page) == [[saved[1]]]
    page.goto(f"{srv.base_url}/dashboard/audit?limit=0")
    assert "limit: '0' is not a number of entries from 1 to 10000" in page.text_content("[role=alert]")
    page.close()
