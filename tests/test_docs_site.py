"""The documentation site as a reader meets it: built with mkdocs, served over HTTP on
127.0.0.1 and opened in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by selenium). Every page of the nav loads with its title,
every link between pages leads to a page that exists, and the search finds an API name.

Skipped where the browser or its driver is not installed (``.ci/run`` installs both)."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built into a fresh folder and served on a free port of 127.0.0.1."""
    out = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        check=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # no request log on stderr
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(out))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1400,1000")
    driver = webdriver.Chrome(
        service=webdriver.ChromeService(executable_path=DRIVER), options=options
    )
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _nav_pages(browser, site: str) -> list[str]:
    from selenium.webdriver.common.by import By

    browser.get(site)
    links = browser.find_elements(By.CSS_SELECTOR, "nav.md-nav--primary a.md-nav__link[href]")
    pages = {site}
    for a in links:
        href = a.get_attribute("href").split("#")[0]
        if href.startswith(site):
            pages.add(href)
    return sorted(pages)


def test_every_page_loads_and_every_link_leads_somewhere(site, browser):
    from selenium.webdriver.common.by import By

    pages = _nav_pages(browser, site)
    assert len(pages) >= 20, pages  # the guide, the other pages and the API reference
    checked: dict[str, int] = {}
    broken = []
    for page in pages:
        browser.get(page)
        h1 = browser.find_elements(By.CSS_SELECTOR, "article h1")
        assert h1 and h1[0].text.strip(), f"{page}: no title"
        assert "404" not in browser.title, page
        for a in browser.find_elements(By.CSS_SELECTOR, "article a[href]"):
            href = a.get_attribute("href")
            if not href.startswith(site):
                continue  # outside the site: not fetched (no network here)
            target = href.split("#")[0]
            if target not in checked:
                try:
                    with urllib.request.urlopen(target, timeout=10) as resp:
                        checked[target] = resp.status
                except urllib.error.HTTPError as exc:
                    checked[target] = exc.code
            if checked[target] != 200:
                broken.append(f"{page} → {href} ({checked[target]})")
    assert not broken, "\n".join(broken)
    assert any("/reference/" in p for p in pages) and any("/guide/" in p for p in pages)


def test_the_api_reference_renders_the_docstrings(site, browser):
    from selenium.webdriver.common.by import By

    browser.get(urllib.parse.urljoin(site, "reference/api/"))
    headings = [h.text for h in browser.find_elements(By.CSS_SELECTOR, ".doc-heading")]
    assert any("Job" in h for h in headings), headings
    assert "duration" in browser.find_element(By.CSS_SELECTOR, "article").text


def test_search_finds_an_api_name(site, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(site)
    browser.find_element(By.CSS_SELECTOR, "label.md-search__icon, .md-search__input").click()
    box = WebDriverWait(browser, 20).until(
        ec.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input"))
    )
    box.send_keys("KeyedProcess")
    results = WebDriverWait(browser, 30).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item a")
    )
    hrefs = [r.get_attribute("href") for r in results]
    assert any("operators" in h for h in hrefs), hrefs
    first = hrefs[0].split("#")[0]
    with urllib.request.urlopen(first, timeout=10) as resp:
        assert resp.status == 200
