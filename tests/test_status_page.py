"""The status page (GET /, api/static/status.html) in a real browser: Debian's chromium
headless, driven by selenium through Debian's chromedriver, against `tlkv serve`.

Marked ``ops``: skipped without /usr/bin/chromium and chromedriver (.ci/run installs them).
Screenshots go to the test's tmp dir; with ``TLKV_ARTEFACTS=DIR`` the page without a token
is also saved as ``DIR/status.png`` (docs/operating.md's image: ``docs/images``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from conftest import SMALL, make_envelope
from http_server import ServerProcess

from kvstore import decode
from kvstore.protocol import ENVELOPE_MEDIA_TYPE

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = pytest.mark.ops

TEAM = "acme/llama@1"
OTHER = "other/model@2"
ADMIN, ALICE = "admin-token-0123456789", "alice-token-0123456789"


def _binaries() -> tuple[str, str]:
    chromium = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("chromium/chromedriver are not installed (Debian chromium, chromium-driver)")
    return chromium, driver


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    chromium, driver = _binaries()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless",
        "--no-sandbox",  # root in CI
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1100,500",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # CSP reports land there
    # An explicit driver path: selenium never looks for (or downloads) a browser itself.
    service = Service(executable_path=driver, log_output=str(tmp_path / "chromedriver.log"))
    b = webdriver.Chrome(options=options, service=service)
    try:
        yield b
    finally:
        b.quit()


def _fill(url: str, token: str | None = None) -> dict[str, int]:
    """Two models of blocks, each block read once and one miss; the blocks per model."""
    headers = {"content-type": ENVELOPE_MEDIA_TYPE}
    if token:
        headers["authorization"] = f"Bearer {token}"
    counts = {}
    for i, (model, n) in enumerate(((TEAM, 5), (OTHER, 3))):
        prefix = "/v1/models/" + model.replace("/", "%2F").replace("@", "%40")
        envelope = make_envelope(SMALL, 4 * n, seed=40 + i)
        r = httpx.put(f"{url}{prefix}/blocks", content=envelope, headers=headers)
        assert r.status_code == 200, r.text
        counts[model] = n
        for h in decode(envelope).hashes:
            assert httpx.get(f"{url}{prefix}/blocks/{int(h):016x}", headers=headers).is_success
        httpx.get(f"{url}{prefix}/blocks/{12345:016x}", headers=headers)  # a miss
    return counts


def _rows(browser: WebDriver) -> dict[str, str]:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 20).until(
        lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1"
    )
    rows = browser.find_elements(By.CSS_SELECTOR, "#models tbody tr")
    return {
        str(r.get_attribute("data-model")): r.find_element(By.CLASS_NAME, "blocks").text
        for r in rows
    }


def _save(browser: WebDriver, tmp_path: Path, name: str, publish: bool = False) -> None:
    """A screenshot in the test's tmp dir (and, ``publish``, in ``$TLKV_ARTEFACTS``)."""
    path = tmp_path / name
    assert browser.save_screenshot(str(path))
    artefacts = os.environ.get("TLKV_ARTEFACTS")
    if artefacts and publish:
        Path(artefacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(artefacts) / name)


def test_page_without_a_token(browser: WebDriver, tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "data", "--capacity", "1MiB") as srv:
        counts = _fill(srv.url)
        browser.get(srv.url + "/")
        rows = _rows(browser)
        assert rows == {TEAM: "5", OTHER: "3", "default": "0"}
        from selenium.webdriver.common.by import By

        text = browser.find_element(By.TAG_NAME, "body").text
        assert "capacity 1.0 MiB" in text and "scrub 64.0 MiB/s" in text
        # The page runs and is styled under its own Content-Security-Policy: nothing refused.
        logs = browser.get_log("browser")  # type: ignore[attr-defined]
        assert not [e for e in logs if "Content Security Policy" in e["message"]], logs
        color = browser.find_element(By.ID, "problem").value_of_css_property("color")  # type: ignore[attr-defined]
        assert color == "rgba(176, 0, 32, 1)", color  # #b00020 from the page's <style>
        assert "no object-store tier" in text
        status = httpx.get(f"{srv.url}/v1/status").json()
        team = next(m for m in status["models"] if m["model"] == TEAM)
        assert team["blocks"] == counts[TEAM]
        assert team["lookups"] == counts[TEAM] + 1 and team["hits"]["local"] == counts[TEAM]
        hit_rate = browser.find_element(By.CSS_SELECTOR, f'tr[data-model="{TEAM}"] .hitrate').text
        assert hit_rate == f"{100 * 5 / 6:.1f}%"
        _save(browser, tmp_path, "status.png", publish=True)


def test_page_with_a_token_table_shows_only_the_tokens_models(
    browser: WebDriver, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    tokens = tmp_path / "tokens.json"
    tokens.write_text(
        json.dumps(
            {
                "tokens": [
                    {"token": ADMIN, "read": ["*"], "write": ["*"]},
                    {"token": ALICE, "read": [TEAM], "write": []},
                ]
            }
        )
    )
    with ServerProcess(tmp_path / "data", "--token-file", str(tokens)) as srv:
        _fill(srv.url, ADMIN)
        assert httpx.get(f"{srv.url}/").status_code == 200  # the page itself needs no token
        assert httpx.get(f"{srv.url}/v1/status").status_code == 401
        browser.get(srv.url + "/")
        login = browser.find_element(By.ID, "login")
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(browser, 20).until(lambda b: login.is_displayed())
        browser.find_element(By.ID, "token").send_keys(ALICE)
        browser.find_element(By.ID, "login-button").click()
        assert _rows(browser) == {TEAM: "5"}  # OTHER and default are not the token's
        body = browser.find_element(By.TAG_NAME, "body").text
        assert OTHER not in body
        _save(browser, tmp_path, "status-token.png")
