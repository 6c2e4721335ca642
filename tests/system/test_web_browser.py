"""The web view in real browsers, against one real coordinator and four agents on loopback
training gpt-tiny: Debian's Firefox (firefox-esr, over Marionette: tests/system/firefox.py)
and Debian's chromium (driven by Playwright). Both look at the same job, Firefox first, since
the Chromium test ends by killing an agent.

In each, the page logs in through the URL `coordinator web-url` prints and loads with no
script error or console error, shows every agent and the grid, and its step advances while the
job trains, and the loss chart and the link heat map draw. In Chromium, besides, the loss chart
draws validation loss too, a SIGKILLed agent shows as lost within seconds, and its JSON is
`coordinator status --json` key for key with a plan and links in it. Screenshots go to
$DTFM_SCREENSHOTS (default: a tmp dir), printed. Each skips, saying what to install, without
its browser: `apt-get install firefox-esr` (or set DTFM_FIREFOX), `apt-get install chromium`
(or set DTFM_CHROMIUM) and `pip install playwright` (the test extra); Playwright's own
browser downloads are not used.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.daemons import Daemons, free_port
from tests.system.firefox import Firefox, firefox_binary
from tests.system.test_web_access import same_keys

pytestmark = pytest.mark.timeout(600)

CHROMIUM = os.environ.get("DTFM_CHROMIUM") or shutil.which("chromium") or ""
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
FIREFOX = firefox_binary()


@dataclass
class WebJob:
    daemons: Daemons
    address: str  # the coordinator's gRPC address
    web: str  # its --web HOST:PORT
    url: str  # what `coordinator web-url` printed: the login URL, token in it
    agents: dict[str, subprocess.Popen[bytes]]  # by name (agent-0...)
    shots: Path  # where screenshots go


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebJob]:
    """One training job for every browser in this module, so CI pays for its start once."""
    tmp = tmp_path_factory.mktemp("web")
    shots = Path(os.environ.get("DTFM_SCREENSHOTS") or tmp / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    print(f"\nweb view screenshots in {shots}")
    daemons = Daemons(tmp)
    try:
        web = f"127.0.0.1:{free_port()}"
        _, address = daemons.coordinator(
            "--web", web, "--model", "gpt-tiny", "--agents", "4", "--stages", "2",
            "--replicas", "2", "--min-agents", "2", "--steps", "400", "--batch", "8",
            "--micro-batches", "2", "--checkpoint-every", "10", "--search-seconds", "1",
            "--eval-every", "10", "--eval-batches", "1")
        agents = {f"agent-{i}": daemons.agent(address, f"agent-{i}") for i in range(4)}
        out = daemons.cli("coordinator", "web-url", "--web", web)
        assert out.returncode == 0, out.stderr
        yield WebJob(daemons, address, web, out.stdout.strip(), agents, shots)
    finally:
        daemons.close()


@pytest.mark.skipif(not FIREFOX, reason="no firefox: apt-get install firefox-esr (or set "
                    "DTFM_FIREFOX) to run the web view's Firefox test")
def test_firefox_follows_a_training_job_live(job: WebJob, tmp_path: Path) -> None:
    with Firefox(FIREFOX, tmp_path / "profile") as ff:
        ff.window(1440, 1100)
        ff.navigate(job.url)
        assert ff.url == f"http://{job.web}/", "the login must leave the token behind"

        ff.wait_until("return Number(document.body.dataset.step) >= 3", timeout=300)
        status = job.daemons.status(job.address)
        ids = {a["id"] for a in status["agents"]}
        assert len(ids) == 4
        shown = ff.execute("return [...document.querySelectorAll('#agents tr[data-agent]')]"
                           ".map(r => r.dataset.agent)")
        assert set(shown) == ids
        grid = ff.execute("return [...document.querySelectorAll('#grid .cell')]"
                          ".map(c => c.dataset.agent)")
        assert [grid[2 * s:2 * s + 2] for s in range(2)] == status["plan"]["grid"]

        before = int(ff.execute("return document.getElementById('step-value').textContent"))
        # on screen, without a reload
        ff.wait_until("return Number(document.getElementById('step-value').textContent) > "
                      f"{before}", timeout=240)
        ff.wait_until("return document.querySelector('#loss-chart svg path')", timeout=30)
        ff.wait_until("return document.querySelector('#links svg rect')", timeout=60)
        ff.screenshot(job.shots / "web-view-firefox.png")
        ff.execute("document.querySelector('button[data-tab=planner]').click()")
        ff.wait_until("return document.querySelector('#plan-now .cell')", timeout=10)
        errors = ff.errors()
        assert errors == [], "\n".join(errors)


@pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                    reason="no playwright: pip install playwright (the test extra)")
@pytest.mark.skipif(not CHROMIUM, reason="no chromium: apt-get install chromium (or set "
                    "DTFM_CHROMIUM) to run the web view's Chromium test")
def test_chromium_follows_a_training_job_live(job: WebJob) -> None:
    from playwright import sync_api

    daemons, address, web, url, shots = job.daemons, job.address, job.web, job.url, job.shots
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
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

            by_id = {(daemons.tmp / n / "agent-id").read_text().strip(): n for n in job.agents}
            victim = status["plan"]["grid"][1][1]
            os.killpg(job.agents[by_id[victim]].pid, signal.SIGKILL)
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
