"""The web view in a real browser: Debian's chromium driven by Playwright, against a real
coordinator and four agents on loopback training gpt-tiny.

The page loads with no console error, shows every agent and the grid, its step advances while
the job trains and the loss chart draws training and validation loss, a SIGKILLed agent shows
as lost within seconds, and its JSON is `coordinator status --json` key for key with a plan
and links in it. Screenshots go to
$DTFM_SCREENSHOTS (default: the test's tmp dir), printed. Skips, saying what to install,
without playwright (`pip install playwright`) or chromium (`apt-get install chromium`):
Playwright's own browser download is not used.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.daemons import Daemons, free_port
from tests.system.test_web_access import same_keys

pytestmark = pytest.mark.timeout(600)

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def chromium() -> str:
    path = os.environ.get("DTFM_CHROMIUM") or shutil.which("chromium") or ""
    if not path:
        pytest.skip("no chromium: apt-get install chromium (or set DTFM_CHROMIUM) to run "
                    "the web view's browser test")
    return path


def test_the_page_follows_a_training_job_live(daemons: Daemons, tmp_path: Path) -> None:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="no playwright: pip install playwright (the test extra)")
    executable = chromium()
    shots = Path(os.environ.get("DTFM_SCREENSHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    print(f"\nweb view screenshots in {shots}")

    web = f"127.0.0.1:{free_port()}"
    _, address = daemons.coordinator(
        "--web", web, "--model", "gpt-tiny", "--agents", "4", "--stages", "2",
        "--replicas", "2", "--min-agents", "2", "--steps", "400", "--batch", "8",
        "--micro-batches", "2", "--checkpoint-every", "10", "--search-seconds", "1",
        "--eval-every", "10", "--eval-batches", "1")
    agents = {f"agent-{i}": daemons.agent(address, f"agent-{i}") for i in range(4)}
    out = daemons.cli("coordinator", "web-url", "--web", web)
    assert out.returncode == 0, out.stderr
    url = out.stdout.strip()

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1100})
            errors: list[str] = []
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            assert page.url == f"http://{web}/", "the login must leave the token behind"

            page.wait_for_function("() => Number(document.body.dataset.step) >= 3",
                                   timeout=300_000)
            status = daemons.status(address)
            ids = {a["id"] for a in status["agents"]}
            assert len(ids) == 4
            rows = page.locator("#agents tr[data-agent]")
            assert {rows.nth(i).get_attribute("data-agent") for i in range(rows.count())} == ids
            cells = page.locator("#grid .cell")
            assert cells.count() == 4
            assert [[cells.nth(2 * s + r).get_attribute("data-agent") for r in range(2)]
                    for s in range(2)] == status["plan"]["grid"]

            before = int(page.inner_text("#step-value"))
            # on screen, without a reload; and far enough for a loss curve in the screenshot
            page.wait_for_function(f"() => Number(document.getElementById('step-value')"
                                   f".textContent) > {max(before + 2, 20)}", timeout=240_000)
            page.wait_for_selector("#loss-chart svg path", timeout=30_000)
            # validation (--eval-every 10): a second series, a dot per evaluation
            page.wait_for_selector('#loss-chart circle[data-series="validation loss"]',
                                   timeout=60_000)
            page.wait_for_selector("#links svg rect", timeout=60_000)
            page.screenshot(path=str(shots / "web-view.png"), full_page=True)

            served = page.request.get(f"http://{web}/api/status").json()
            printed = daemons.status(address)
            assert served["plan"] and served["links"] and printed["plan"] and printed["links"]
            assert same_keys(served, printed) == [] and same_keys(printed, served) == []

            by_id = {(daemons.tmp / n / "agent-id").read_text().strip(): n for n in agents}
            victim = status["plan"]["grid"][1][1]
            os.killpg(agents[by_id[victim]].pid, signal.SIGKILL)
            killed = time.monotonic()
            page.wait_for_selector(f'#agents tr[data-agent="{victim}"][data-state="lost"]',
                                   timeout=15_000)
            elapsed = time.monotonic() - killed
            # liveness timeout 3 s, the sweep and a one-second push on top
            assert elapsed < 3 + 4, f"shown lost only after {elapsed:.1f} s"
            page.wait_for_selector("#events li.lost", timeout=10_000)
            page.screenshot(path=str(shots / "web-view-lost.png"), full_page=True)
            page.click("button[data-tab=planner]")
            page.wait_for_selector("#plan-now .cell")
            page.screenshot(path=str(shots / "web-view-planner.png"), full_page=True)
            assert errors == [], json.dumps(errors)
        finally:
            browser.close()
