"""The book as a site (site/build.py), opened in a real headless browser.

The site is built once for this module, its notebooks executed (or taken from the builder's cache
of executed notebooks, build/site-cache/), served on localhost, and every page reachable from the
home page is rendered by chromium (`--dump-dom` after the page's scripts ran, MathJax included).
Then: every chapter page has its title and no formula left as TeX; every notebook page shows as
many plots as its executed notebook holds (and every notebook that plots holds some); no local
link, script, stylesheet or image is missing, nor any #anchor a link points to; the search index
holds every page.

The checks also look at the pages as a reader sees them. The test's server adds a probe script
to every HTML page it serves; once MathJax has typeset and the fonts and images have loaded, the
probe writes what it saw into the page, and chromium's DOM dump carries it out: how many formulas
MathJax drew, which images loaded, and which characters of the visible text no loaded font can
draw (each drawn on a canvas in its element's font and compared with the box of a character no
font has). Each text page is also photographed (chromium --screenshot) and must not be blank.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
import zlib
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
        self.probe: dict | None = None  # what the probe script saw (see PROBE)
        self.text: list[str] = []       # every piece of text
        self._probe_text: list[str] | None = None
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
        if tag == "script" and attrs.get("id") == PROBE_ID:
            self._probe_text = []
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
        if tag == "script" and self._probe_text is not None:
            self.probe = json.loads("".join(self._probe_text))
            self._probe_text = None
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
        if self._probe_text is not None:
            self._probe_text.append(data)
            return
        self.text.append(data)
        if self._h1_text is not None:
            self._h1_text.append(data)
        if not any(tag in NO_TEXT for tag, _ in self.stack) and any(d in data for d in RAW_MATH):
            self.raw_math.append(data.strip()[:120])


# --- the site, served and crawled ----------------------------------------------------------


SCREEN = (1280, 2000)   # the window: wide enough for both of the theme's sidebars


def render(url: str, screenshot: Path | None = None) -> str:
    """The DOM of url after its scripts ran, as chromium serializes it; and, if asked, a
    screenshot of the page's top (same run)."""
    shot = [f"--window-size={SCREEN[0]},{SCREEN[1]}", "--hide-scrollbars",
            f"--screenshot={screenshot}"] if screenshot is not None else []
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        result = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", "--no-default-browser-check", f"--user-data-dir={profile}",
             "--virtual-time-budget=15000",  # lets MathJax finish typesetting before the dump
             *shot, "--dump-dom", url],
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


PROBE_ID = "site-test-probe"
CJK_BLOCKS = builder.CJK_BLOCKS   # what the site's font draws
# Runs last on every page. Waits for MathJax's typesetting, the fonts and the images, then
# writes into the page (a JSON script element) what a reader would see.
PROBE = r"""
(async () => {
  const result = {};
  try {
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
    for (const img of document.images) img.loading = "eager";
    await Promise.all([...document.images].map((img) => img.complete ? null : new Promise((done) => {
      img.addEventListener("load", done); img.addEventListener("error", done); })));
    document.body.getBoundingClientRect();   // lay out what MathJax added: its fonts load now
    await document.fonts.ready;
    result.mjx = document.querySelectorAll("mjx-container").length;
    result.images = [...document.images].map((img) => [img.getAttribute("src"), img.naturalWidth]);

    // The visible text's characters beyond ASCII, by the font their element asks for.
    const byFont = new Map();
    const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      const element = node.parentElement;
      if (!element || element.closest("mjx-container, script, style, noscript, template")) continue;
      const chars = [...node.data].filter((c) => c.codePointAt(0) > 127 && c.trim() !== "");
      if (!chars.length || !element.getClientRects().length) continue;
      const style = getComputedStyle(element);
      if (style.visibility !== "visible") continue;
      const font = `${style.fontStyle} ${style.fontWeight} 32px ${style.fontFamily}`;
      if (!byFont.has(font)) byFont.set(font, new Set());
      chars.forEach((c) => byFont.get(font).add(c));
    }
    // A character no font draws shows as the same box as U+0378 (unassigned).
    const canvas = document.createElement("canvas");
    canvas.width = canvas.height = 48;
    const context = canvas.getContext("2d", { willReadFrequently: true });
    const pixels = (font, c) => {
      context.clearRect(0, 0, 48, 48);
      context.font = font;
      context.fillText(c, 4, 36);
      return context.getImageData(0, 0, 48, 48).data.join();
    };
    const cjkBlocks = CJK_BLOCKS;
    const isCjk = (c) => cjkBlocks.some(([first, last]) => c.codePointAt(0) >= first && c.codePointAt(0) <= last);
    const cjk = new Set();
    result.chars = 0;
    result.tofu = [];
    for (const [font, chars] of byFont) {
      const box = pixels(font, "\u0378");
      for (const c of chars) {
        result.chars += 1;
        if (isCjk(c)) cjk.add(c);
        if (pixels(font, c) === box) {
          result.tofu.push(`${c} (U+${c.codePointAt(0).toString(16).toUpperCase()}) in ${font}`);
        }
      }
    }
    result.cjk = [...cjk].join("");
    result.cjkCovered = document.fonts.check('16px "Noto Sans SC"', result.cjk);
    result.notoLoaded = [...document.fonts].filter(
      (face) => face.family.replace(/["']/g, "") === "Noto Sans SC" && face.status === "loaded").length;
  } catch (error) {
    result.error = String(error);
  }
  const out = document.createElement("script");
  out.type = "application/json";
  out.id = "PROBE_ID";
  out.textContent = JSON.stringify(result).replace(/</g, "\\u003c");
  document.body.appendChild(out);
})();
""".replace("PROBE_ID", PROBE_ID).replace("CJK_BLOCKS", json.dumps(CJK_BLOCKS))


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the site, with PROBE added at the end of every HTML page."""

    def log_message(self, *args):
        pass

    def send_head(self):
        path = self.translate_path(self.path)
        if os.path.isdir(path) and self.path.split("?")[0].endswith("/"):
            path = os.path.join(path, "index.html")
        if not path.endswith(".html") or not os.path.isfile(path):
            return super().send_head()
        head, body, tail = Path(path).read_bytes().rpartition(b"</body>")
        page = head + f"<script>{PROBE}</script>".encode() + body + tail
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        return io.BytesIO(page)


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
               "mathjax": "MathJax NOT served" not in build.stderr,
               "font": f"{builder.FONT_FAMILY} NOT served" not in build.stderr}
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def crawl(site, tmp_path_factory):
    """Every page reachable from the home page, rendered: {url: Page}; every broken link; and
    {url: screenshot} of the text pages."""
    base = site["url"]
    pages: dict[str, Page] = {}
    status: dict[str, tuple[int, str]] = {}
    anchors: list[tuple[str, str, str]] = []   # (page, link, target url with #fragment)
    broken: list[str] = []
    shots = tmp_path_factory.mktemp("screenshots")
    screenshots = {page_url(site, source): shots / ("-".join(source.relative_to(ROOT).parts[1:])
                                                     .removesuffix(".md") + ".png")
                   for source in text_pages()}
    wave = [base]
    with ThreadPoolExecutor(max_workers=2) as pool:
        while wave:
            for url, dom in zip(wave, pool.map(lambda url: render(url, screenshots.get(url)), wave)):
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
    return {"pages": pages, "broken": broken, "screenshots": screenshots}


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


# --- what a reader sees ----------------------------------------------------------------------

CODE_FENCE = re.compile(r"^ *(```|~~~).*?^ *\1", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.DOTALL)
# pymdownx.arithmatex's dollars: $$...$$, or $...$ with no space inside either dollar, not \$
MATH = re.compile(r"\$\$.+?\$\$|(?<![\\$])\$(?![\s$])(?:\\.|[^\\$])+?(?<![\s\\])\$", re.DOTALL)


def prose(markdown: str) -> str:
    """markdown without its code: fenced blocks dropped, code spans replaced by `code`."""
    return CODE_SPAN.sub("code", CODE_FENCE.sub("", markdown))


def has_math(markdown: str) -> bool:
    return MATH.search(prose(markdown)) is not None


def test_has_math_reads_the_dollars():
    assert has_math("the bubble is $(p-1)/m$ of the step")
    assert has_math("so\n\n$$\nB = \\frac{p-1}{m}\n$$\n")
    assert not has_math("costs \\$5, or `$HOME`, or\n```bash\necho $x $y\n```\n")
    assert not has_math("between $5 and $ 10")


def probe(crawl, url: str) -> dict:
    page = crawl["pages"][url]
    assert page.probe is not None, f"{url}: the probe did not finish (MathJax, fonts or images hung?)"
    assert "error" not in page.probe, f"{url}: the probe failed: {page.probe['error']}"
    return page.probe


def test_every_formula_is_drawn_by_mathjax(site, crawl):
    """Every text page whose Markdown has $ math shows MathJax's output (mjx-container)."""
    if not site["mathjax"]:
        pytest.skip("MathJax could not be fetched from npm (see the site build's output)")
    with_math = [p for p in text_pages() if has_math(p.read_text(encoding="utf-8"))]
    drawn = {p: probe(crawl, page_url(site, p))["mjx"] for p in text_pages()}
    undrawn = [str(p.relative_to(ROOT)) for p in with_math if drawn[p] == 0]
    assert not undrawn, "math in the source, none drawn by MathJax: " + ", ".join(undrawn)


def test_every_image_loads(crawl):
    failed = [f"{url}: {src}" for url in crawl["pages"]
              for src, width in probe(crawl, url)["images"] if width == 0]
    assert not failed, "images that did not load:\n" + "\n".join(failed)


def test_every_character_has_a_font(site, crawl):
    """No empty boxes: every character beyond ASCII of a text page's visible text is drawn by a
    loaded font; the Chinese terms by the site's Noto Sans SC."""
    tofu, unloaded = [], []
    for source in text_pages():
        url = page_url(site, source)
        seen = probe(crawl, url)
        assert seen["chars"] > 0, f"{url}: the probe saw no character beyond ASCII"
        tofu += [f"{url}: {c}" for c in seen["tofu"]]
        title = builder.title_of(source.read_text(encoding="utf-8"), "")
        in_title = {c for c in title if any(a <= ord(c) <= b for a, b in CJK_BLOCKS)}
        assert in_title <= set(seen["cjk"]), f"{url}: the probe missed {in_title - set(seen['cjk'])}"
        if seen["cjk"] and not (seen["cjkCovered"] and seen["notoLoaded"] > 0):
            unloaded.append(f"{url}: {seen['notoLoaded']} faces loaded for {seen['cjk'][:40]}")
    if not site["font"]:
        tofu = [t for t in tofu if not any(a <= ord(t.split(": ", 1)[1][0]) <= b for a, b in CJK_BLOCKS)]
    assert not tofu, "characters drawn as boxes:\n" + "\n".join(tofu)
    if not site["font"]:
        pytest.skip(f"{builder.FONT_FAMILY} could not be fetched from npm (see the site build's output)")
    assert any(probe(crawl, page_url(site, p))["cjk"] for p in text_pages())
    assert not unloaded, f"{builder.FONT_FAMILY} did not load:\n" + "\n".join(unloaded)


def png_ink(path: Path) -> tuple[int, int, float]:
    """A PNG's width, height and share of nonzero bytes in its filtered scanlines (a blank
    page is ~0: each row repeats the one above)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    offset, idat, width, height = 8, [], 0, 0
    while offset < len(data):
        (length,), kind = struct.unpack(">I", data[offset:offset + 4]), data[offset + 4:offset + 8]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", data[offset + 8:offset + 16])
        elif kind == b"IDAT":
            idat.append(data[offset + 8:offset + 8 + length])
        offset += 12 + length
    rows = zlib.decompress(b"".join(idat))
    return width, height, 1 - rows.count(0) / len(rows)


def test_every_text_page_screenshot_shows_the_page(crawl):
    for url, path in crawl["screenshots"].items():
        assert path.exists(), f"no screenshot of {url}"
        width, height, ink = png_ink(path)
        assert (width, height) == SCREEN, f"{path}: {width}x{height}"
        assert ink > 0.01, f"{path} ({url}) is blank: {ink:.4f} of its bytes drawn"


def test_home_page_shows_the_quick_start(site, crawl):
    home = crawl["pages"][site["url"]]
    text = " ".join("".join(home.text).split())
    sections = dict(builder.readme_sections((ROOT / "README.md").read_text(encoding="utf-8")))
    for name in builder.HOME_SECTIONS:
        assert name in sections, f"README.md has no section {name!r}"
        code = "\n".join(m.group(0) for m in CODE_FENCE.finditer(sections[name]))
        for line in code.splitlines():
            if line.strip() and not line.lstrip().startswith(("```", "~~~")):
                assert " ".join(line.split()) in text, f"the home page lacks {line.strip()!r}"
    assert "quick-start" in home.ids
    links = {urllib.parse.urljoin(site["url"], link) for link in home.links}
    assert {page_url(site, c["path"]) for c in PARTS["chapters"]} <= links


def test_cross_references_resolve(site, crawl):
    """Every link of the book's Markdown (text pages and notebooks) resolves: to a page of the
    book and the heading it names; to a repository file, which the site serves too; to a figure
    the builder drew (chapters/figures/, not in the repository)."""
    notebooks = [c["notebook"] for c in PARTS["chapters"]]
    book = set(text_pages()) | set(notebooks)
    broken, anchors, files = [], 0, 0
    for source in text_pages() + notebooks:
        for target in builder.LINK.findall(prose(builder.markdown_of(source))):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue   # another site
            path, _, fragment = target.partition("#")
            where = f"{source.relative_to(ROOT)}: {target}"
            file = Path(os.path.normpath(source.parent / urllib.parse.unquote(path))) if path else source
            if file in book:
                url = page_url(site, file)
                if url not in crawl["pages"]:
                    broken.append(f"{where} -> {url} not reachable from the home page")
                elif fragment:
                    anchors += 1
                    if urllib.parse.unquote(fragment) not in crawl["pages"][url].ids:
                        broken.append(f"{where} -> no heading with id {fragment!r}")
                continue
            if not file.is_relative_to(ROOT):
                broken.append(f"{where} -> outside the repository")
                continue
            drawn = file.parent == ROOT / "chapters" / "figures"
            if not drawn and not file.is_file():
                broken.append(f"{where} -> " + ("a folder: link a file" if file.is_dir()
                                                else "no such file in the repository"))
                continue
            files += 1
            url = site["url"] + file.relative_to(ROOT).as_posix()
            if fetch(url)[0] != 200:
                broken.append(f"{where} -> {url} not served")
    assert not broken, "\n".join(broken)
    assert anchors > 0 and files > 0
