"""The book as a site (site/build.py), opened in a real headless browser.

The site is built once for this module, its notebooks executed (or taken from the builder's cache
of executed notebooks, build/site-cache/), served on localhost, and every page reachable from the
home page is rendered by chromium (`--dump-dom` after the page's scripts ran, MathJax included).
Then: every chapter page has its title and no formula left as TeX; every notebook page shows as
many plots as its executed notebook holds (and every notebook that plots holds some); no local
link, script, stylesheet or image is missing, nor any #anchor a link points to; the search index
holds every page.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed: "
                       "apt-get update && apt-get install -y chromium (as root)"),
    # Executing every notebook takes minutes (seconds when build/site-cache has them).
    pytest.mark.timeout(1800),
    pytest.mark.full,
]


def load_builder():
    spec = importlib.util.spec_from_file_location("site_build", ROOT / "site" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


builder = load_builder()
PARTS = builder.book_parts(ROOT)


# --- what a rendered page holds ------------------------------------------------------------

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param",
        "source", "track", "wbr"}
NO_TEXT = {"pre", "code", "script", "style", "textarea", "mjx-container"}
RAW_MATH = ("$$", "\\[", "\\(")


class Page(HTMLParser):
    """The parts of a rendered DOM the checks need."""

    def __init__(self, dom: str):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, set[str]]] = []
        self.links: list[str] = []      # href/src of a, link, script, img, iframe
        self.ids: set[str] = set()
        self.h1: list[str] = []
        self.math = 0                   # .arithmatex elements
        self.math_rendered = 0          # ... holding MathJax's output
        self.raw_math: list[str] = []   # text outside code still holding TeX delimiters
        self.plots = 0                  # img/svg in notebook output areas
        self._h1_text: list[str] | None = None
        self._math_open: list[bool] = []
        self.feed(dom)

    def inside(self, css_class: str) -> bool:
        return any(css_class in classes for _, classes in self.stack)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = set((attrs.get("class") or "").split())
        for name in ("id", "name") if tag == "a" else ("id",):
            if attrs.get(name):
                self.ids.add(attrs[name])
        for name in ("href", "src"):
            if tag in {"a", "link", "script", "img", "iframe"} and attrs.get(name):
                self.links.append(attrs[name])
        if tag in {"img", "svg"} and self.inside("jp-OutputArea-output") and not any(
                t == "svg" for t, _ in self.stack):
            self.plots += 1
        if tag == "mjx-container" and self._math_open:
            self._math_open[-1] = True
        if tag == "h1":
            self._h1_text = []
        if tag in VOID:
            return
        if "arithmatex" in classes:
            self.math += 1
            self._math_open.append(False)
        self.stack.append((tag, classes))

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        if tag in VOID or all(open_tag != tag for open_tag, _ in self.stack):
            return
        while self.stack:
            open_tag, classes = self.stack.pop()
            if "arithmatex" in classes:
                self.math_rendered += self._math_open.pop()
            if open_tag == "h1" and self._h1_text is not None:
                self.h1.append("".join(self._h1_text).replace("¶", "").strip())
                self._h1_text = None
            if open_tag == tag:
                break

    def handle_data(self, data):
        if self._h1_text is not None:
            self._h1_text.append(data)
        if not any(tag in NO_TEXT for tag, _ in self.stack) and any(d in data for d in RAW_MATH):
            self.raw_math.append(data.strip()[:120])


# --- the site, served and crawled ----------------------------------------------------------


def render(url: str) -> str:
    """The DOM of url after its scripts ran, as chromium serializes it."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        result = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", "--no-default-browser-check", f"--user-data-dir={profile}",
             "--virtual-time-budget=15000",  # lets MathJax finish typesetting before the dump
             "--dump-dom", url],
            capture_output=True, text=True, timeout=120,
        )
    assert result.returncode == 0 and "<html" in result.stdout, (
        f"chromium could not render {url}: {result.stderr[-2000:]}")
    return result.stdout


def fetch(url: str) -> tuple[int, str]:
    """HTTP status and content type of url."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.headers.get_content_type()
    except urllib.error.HTTPError as error:
        return error.code, ""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # chromium hung up: fine
            super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site") / "site"
    build = subprocess.run([sys.executable, str(ROOT / "site" / "build.py"), str(out)],
                           capture_output=True, text=True, cwd=ROOT)
    sys.stderr.write(build.stderr[-3000:])
    assert build.returncode == 0, build.stderr[-5000:]
    server = Server(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(out)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"dir": out, "url": f"http://127.0.0.1:{server.server_address[1]}/",
               "mathjax": "MathJax NOT served" not in build.stderr}
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def crawl(site):
    """Every page reachable from the home page, rendered: {url: Page}; and every broken link."""
    base = site["url"]
    pages: dict[str, Page] = {}
    status: dict[str, tuple[int, str]] = {}
    anchors: list[tuple[str, str, str]] = []   # (page, link, target url with #fragment)
    broken: list[str] = []
    wave = [base]
    with ThreadPoolExecutor(max_workers=2) as pool:
        while wave:
            for url, dom in zip(wave, pool.map(render, wave)):
                pages[url] = Page(dom)
            targets = []
            for url in wave:
                for link in pages[url].links:
                    target = urllib.parse.urljoin(url, link)
                    if not target.startswith(base):       # another site, data:, mailto:
                        continue
                    resource, _, fragment = target.partition("#")
                    if fragment:
                        anchors.append((url, link, target))
                    if resource not in status:
                        status[resource] = fetch(resource)
                        targets.append(resource)
                        if status[resource][0] != 200:
                            broken.append(f"{url}: {link} -> HTTP {status[resource][0]}")
            wave = [t for t in targets if status[t] == (200, "text/html") and t not in pages]
    for url, link, target in anchors:
        resource, _, fragment = target.partition("#")
        page = pages.get(resource)
        if page is not None and urllib.parse.unquote(fragment) not in page.ids:
            broken.append(f"{url}: {link} -> no element with id {fragment!r}")
    return {"pages": pages, "broken": broken}


def page_url(site, source: Path) -> str:
    """The URL mkdocs gives a chapter or notebook (directory URLs)."""
    relative = source.relative_to(ROOT).with_suffix("")
    return site["url"] + relative.as_posix() + "/"


# --- the checks ----------------------------------------------------------------------------


def test_the_book_has_its_parts():
    assert [c["number"] for c in PARTS["chapters"]][:8] == [f"{n:02d}" for n in range(1, 9)]
    assert all(c["notebook"] is not None for c in PARTS["chapters"])
    assert len(PARTS["appendices"]) >= 1


def text_pages():
    return ([c["path"] for c in PARTS["chapters"]] + [a["path"] for a in PARTS["appendices"]]
            + [s["path"] for s in PARTS["solutions"]])


def test_every_chapter_page_renders(site, crawl):
    pages = text_pages()
    assert len(pages) == len(PARTS["chapters"]) + len(PARTS["appendices"]) + len(PARTS["solutions"])
    for source in pages:
        url = page_url(site, source)
        assert url in crawl["pages"], f"{url} is not reachable from the home page"
        page = crawl["pages"][url]
        title = builder.title_of(source.read_text(encoding="utf-8"), None)
        assert title in page.h1, f"{url}: title {title!r} not among {page.h1}"
        notebook = next((c["notebook"] for c in PARTS["chapters"] if c["path"] == source), None)
        if notebook is not None:   # the nav puts each chapter's notebook next to it
            links = {urllib.parse.urljoin(url, link) for link in page.links}
            assert page_url(site, notebook) in links, f"{url} does not link to its notebook"
        if site["mathjax"]:
            assert page.math_rendered == page.math, (
                f"{url}: {page.math - page.math_rendered} of {page.math} formulas not typeset")
            assert page.raw_math == [], f"{url}: TeX left as text: {page.raw_math[:5]}"


def test_math_is_typeset(site, crawl):
    """At least one formula of the book goes through MathJax (chapter 2 has one)."""
    if not site["mathjax"]:
        pytest.skip("MathJax could not be fetched from npm (see the site build's output)")
    assert sum(crawl["pages"][page_url(site, p)].math_rendered for p in text_pages()) >= 1


def test_every_notebook_page_shows_its_plots(site, crawl):
    notebooks = [c["notebook"] for c in PARTS["chapters"]]
    assert len(notebooks) == len(PARTS["chapters"])
    for notebook in notebooks:
        url = page_url(site, notebook)
        assert url in crawl["pages"], f"{url} is not reachable from the home page"
        page = crawl["pages"][url]
        executed = json.loads((site["dir"] / notebook.relative_to(ROOT).with_suffix("")
                               / notebook.name).read_text(encoding="utf-8"))
        code = [c for c in executed["cells"] if c["cell_type"] == "code"]
        assert all(c["execution_count"] is not None for c in code), f"{notebook.name} not executed"
        images = sum(1 for c in code for o in c["outputs"]
                     if {"image/png", "image/svg+xml"} & set(o.get("data", {})))
        if any("plt." in "".join(c["source"]) or "plot" in "".join(c["source"]) for c in code):
            assert images > 0, f"{notebook.name} plots but its executed copy holds no image"
        assert page.plots == images, f"{url}: {page.plots} plots shown, {images} in the notebook"
        assert page.h1, f"{url} has no title"


def test_no_internal_link_is_broken(crawl):
    assert len(crawl["pages"]) >= 1 + len(text_pages()) + len(PARTS["chapters"])
    assert not crawl["broken"], "\n".join(crawl["broken"])


def test_search_index_holds_every_page(site):
    index = json.loads((site["dir"] / "search" / "search_index.json").read_text(encoding="utf-8"))
    locations = {doc["location"].split("#")[0] for doc in index["docs"]}
    expected = [page_url(site, p)[len(site["url"]):] for p in text_pages()]
    expected += [page_url(site, c["notebook"])[len(site["url"]):] for c in PARTS["chapters"]]
    assert len(expected) == len(text_pages()) + len(PARTS["chapters"])
    assert set(expected) <= locations, sorted(set(expected) - locations)
