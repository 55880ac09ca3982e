"""Build the book as a static site: python site/build.py [OUT] [--no-execute]

mkdocs cannot use the repository root as its docs folder, so this script assembles one:

- chapters/ (the texts, the appendix, solutions/ and any figures), as they are, and the book's
  figures drawn by site/figures.py (`write_figures(out)`) into chapters/figures/;
- notebooks/NN_*.ipynb, executed top to bottom so that every plot is in the page (nbclient,
  with a progress bar); executed notebooks are cached under --cache, keyed by the notebook's
  bytes and the minidist sources, so an unchanged book builds in seconds;
- index.md (the README's opening, its Quick start and a table of the chapters);
- MathJax 3 from the npm registry (`npm install mathjax@3` into --cache), served by the site
  itself: no CDN, so the math renders offline;
- the Noto Sans SC font from the npm registry (@fontsource/noto-sans-sc, also into --cache) for
  the Chinese terms, split into unicode-range subsets so a page downloads only those it uses:
  without it a machine with no CJK font shows them as empty boxes;
- any repository file a chapter or notebook links to (e.g. ../minidist/parallel/zero.py), so the
  link works (site/hooks.py points a notebook's links at the site's pages and files);

then writes a config that inherits site/mkdocs.yml, adds the nav (each chapter's notebook next
to it, then the appendix and the solutions), and runs `mkdocs build`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "site"
DEFAULT_OUT = ROOT / "build" / "site"
DEFAULT_CACHE = ROOT / "build" / "site-cache"
MATHJAX_PACKAGE = "mathjax@3"
# What the site serves of MathJax's es5/ folder: the TeX-to-HTML component and what it loads
# on demand (fonts, TeX extensions, the menu). Not the speech engine (sre, 4 MB) or SVG output.
MATHJAX_PARTS = ["tex-chtml.js", "input", "output/chtml", "output/chtml.js", "ui", "a11y", "adaptors"]
FONT_PACKAGE = "@fontsource/noto-sans-sc@5"
FONT_FAMILY = "Noto Sans SC"
# About 2.4 MB of woff2 per weight (its CJK subsets); bold and light are synthesized from 400.
FONT_WEIGHTS = ["400"]
FONT_DIR = "stylesheets/fonts/noto-sans-sc"   # where the site serves it
CELL_TIMEOUT_S = 300  # as the test suite's nbmake timeout


def say(message: str) -> None:
    print(f"[site] {message}", file=sys.stderr, flush=True)


# --- the book's parts ------------------------------------------------------------------------


def title_of(markdown: str, default: str) -> str:
    for line in markdown.splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return default


def notebook_title(path: Path, default: str) -> str:
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] == "markdown":
            return title_of("".join(cell["source"]), default)
    return default


def book_parts(root: Path) -> dict:
    """The chapters in order, each with its notebook (if any); the appendices; the solutions."""
    chapters = []
    for md in sorted((root / "chapters").glob("[0-9][0-9]_*.md")):
        number = md.name[:2]
        notebooks = sorted((root / "notebooks").glob(f"{number}_*.ipynb"))
        chapters.append({
            "number": number,
            "path": md,
            "title": title_of(md.read_text(encoding="utf-8"), md.stem),
            "notebook": notebooks[0] if notebooks else None,
        })
    appendices = [
        {"path": md, "title": title_of(md.read_text(encoding="utf-8"), md.stem)}
        for md in sorted((root / "chapters").glob("appendix*.md"))
    ]
    solutions = [
        {"path": md, "title": title_of(md.read_text(encoding="utf-8"), f"Solutions, chapter {md.stem}")}
        for md in sorted((root / "chapters" / "solutions").glob("*.md"))
    ]
    return {"chapters": chapters, "appendices": appendices, "solutions": solutions}


# --- executing the notebooks, cached ---------------------------------------------------------


def sources_digest(root: Path) -> str:
    """One hash of the library's sources: a notebook's outputs depend on them too."""
    digest = hashlib.sha256()
    for path in sorted((root / "minidist").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_path(cache: Path, notebook: Path, library: str) -> Path:
    key = hashlib.sha256(notebook.read_bytes() + library.encode()).hexdigest()[:16]
    return cache / "notebooks" / f"{notebook.stem}-{key}.ipynb"


def execute_notebooks(notebooks: list[Path], cache: Path, root: Path) -> dict[Path, Path]:
    """Each notebook -> its executed copy in the cache (executing those not cached yet)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from nbformat.validator import MissingIDFieldWarning
    from tqdm import tqdm

    warnings.simplefilter("ignore", MissingIDFieldWarning)  # committed notebooks carry no cell ids

    library = sources_digest(root)
    executed = {nb: cache_path(cache, nb, library) for nb in notebooks}
    todo = [nb for nb, out in executed.items() if not out.exists()]
    say(f"notebooks: {len(notebooks) - len(todo)} cached, {len(todo)} to execute")
    if not todo:
        return executed
    books = {nb: nbformat.read(nb, as_version=4) for nb in todo}
    cells = sum(sum(c.cell_type == "code" for c in book.cells) for book in books.values())
    start = time.perf_counter()
    with tqdm(total=cells, unit="cell", desc="executing notebooks", file=sys.stderr) as bar:
        for nb, book in books.items():
            bar.set_postfix_str(nb.name)
            client = NotebookClient(
                book,
                timeout=CELL_TIMEOUT_S,
                kernel_name="python3",
                resources={"metadata": {"path": str(nb.parent)}},  # run where nbmake runs it
                on_cell_executed=lambda **_: bar.update(1),
            )
            try:
                client.execute()
            except CellExecutionError as error:
                bar.close()
                raise SystemExit(f"[site] {nb.relative_to(root)} failed: {error.ename}: {error.evalue}"
                                 " (run it in Jupyter to see the cell)") from None
            out = executed[nb]
            out.parent.mkdir(parents=True, exist_ok=True)
            for stale in out.parent.glob(f"{nb.stem}-*.ipynb"):
                stale.unlink()
            partial = out.with_suffix(".partial")
            nbformat.write(book, partial)
            partial.replace(out)  # a cached notebook is always a complete run
    say(f"executed {len(todo)} notebooks in {time.perf_counter() - start:.0f} s")
    return executed


# --- MathJax and a font, from the npm registry ----------------------------------------------


def npm_install(prefix: Path, package: str, wanted: Path, what: str) -> bool:
    """`npm install package` into prefix once; whether `wanted` is there afterwards.

    Each package gets a prefix of its own: npm prunes from a prefix what it was not asked for."""
    if wanted.exists():
        return True
    npm = shutil.which("npm")
    if npm is None:
        say(f"{what}: npm is not installed")
        return False
    prefix.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [npm, "install", "--silent", "--no-audit", "--no-fund", "--no-save", "--prefix", str(prefix),
         package],
        capture_output=True, text=True,
    )
    if result.returncode != 0 or not wanted.exists():
        say(f"{what}: `npm install {package}` failed\n" + result.stderr.strip()[-2000:])
        return False
    return True


def fetch_mathjax(cache: Path) -> Path | None:
    """MathJax's es5/ folder (npm install into the cache once), or None if it cannot be had."""
    es5 = cache / "npm" / "node_modules" / "mathjax" / "es5"
    if npm_install(cache / "npm", MATHJAX_PACKAGE, es5 / "tex-chtml.js",
                   "MathJax NOT served (math shows as TeX source)"):
        return es5
    return None


def copy_mathjax(es5: Path, target: Path) -> None:
    for part in MATHJAX_PARTS:
        source = es5 / part
        if source.is_dir():
            shutil.copytree(source, target / part)
        elif source.exists():
            (target / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / part)


def fetch_font(cache: Path) -> Path | None:
    """The @fontsource package's folder (npm install into the cache once), or None."""
    package = cache / "npm-fonts" / "node_modules" / "@fontsource" / "noto-sans-sc"
    if npm_install(cache / "npm-fonts", FONT_PACKAGE, package / f"{FONT_WEIGHTS[0]}.css",
                   f"{FONT_FAMILY} NOT served (Chinese shows as boxes where no CJK font is installed)"):
        return package
    return None


FONT_URL = re.compile(r"url\(\s*['\"]?\./files/([^'\")]+\.woff2)['\"]?\s*\)\s*format\(['\"]woff2['\"]\)")
# The Unicode blocks of Chinese text: radicals, CJK punctuation, kana and bopomofo, the
# ideographs, compatibility ideographs and forms, full-width forms, the supplementary ideographs.
CJK_BLOCKS = [(0x2E80, 0x9FFF), (0xF900, 0xFAFF), (0xFE30, 0xFE4F), (0xFF00, 0xFFEF),
              (0x20000, 0x3FFFF)]


def cjk_only(unicode_range: str) -> str:
    """A unicode-range cut down to CJK_BLOCKS ("" if nothing is left).

    The font's subsets also hold Latin letters, punctuation and symbols; cut down, it never
    draws those, so it can come first in the font stacks (see site/stylesheets/extra.css) and
    leave all other text to the theme's fonts."""
    kept = []
    for part in unicode_range.split(","):
        part = part.strip().upper().removeprefix("U+")
        low, _, high = part.partition("-")
        if "?" in low:
            low, high = low.replace("?", "0"), low.replace("?", "F")
        for block_first, block_last in CJK_BLOCKS:
            first, last = max(int(low, 16), block_first), min(int(high or low, 16), block_last)
            if first <= last:
                kept.append(f"U+{first:X}" + (f"-{last:X}" if last > first else ""))
    return ", ".join(kept)


def copy_font(package: Path, target: Path) -> int:
    """The font's @font-face rules (woff2 only, CJK ranges only) and the woff2 subsets they name
    into target; returns the bytes copied.

    Each rule carries a unicode-range, so a browser downloads only the subsets whose characters
    a page shows (a few hundred KB for a chapter)."""
    (target / "files").mkdir(parents=True, exist_ok=True)
    rules = []
    for weight in FONT_WEIGHTS:
        css = (package / f"{weight}.css").read_text(encoding="utf-8")
        for rule in re.findall(r"@font-face\s*{[^}]*}", css):
            woff2 = FONT_URL.search(rule)
            ranges = re.search(r"unicode-range:([^;]*);", rule)
            if woff2 is None or ranges is None or not cjk_only(ranges.group(1)):
                continue
            rule = re.sub(r"src:[^;]*;", f"src: url(files/{woff2.group(1)}) format('woff2');", rule)
            rules.append(rule.replace(ranges.group(0), f"unicode-range: {cjk_only(ranges.group(1))};"))
            shutil.copy2(package / "files" / woff2.group(1), target / "files" / woff2.group(1))
    version = json.loads((package / "package.json").read_text(encoding="utf-8"))["version"]
    (target / "noto-sans-sc.css").write_text(
        f"/* {FONT_FAMILY} {version} from @fontsource/noto-sans-sc (SIL Open Font License 1.1,"
        " see LICENSE), its CJK subsets */\n" + "\n".join(rules) + "\n", encoding="utf-8")
    shutil.copy2(package / "LICENSE", target / "LICENSE")
    return sum(f.stat().st_size for f in target.rglob("*") if f.is_file())


# --- the docs folder -------------------------------------------------------------------------

LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def markdown_of(path: Path) -> str:
    """A page's Markdown: a .md file's text, a notebook's Markdown cells."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text(encoding="utf-8")


def copy_linked_files(docs: Path, root: Path) -> list[str]:
    """Copy into docs the repository files that its Markdown (pages and notebooks) links to but
    it lacks."""
    copied = []
    for page in sorted(docs.rglob("*.md")) + sorted(docs.rglob("*.ipynb")):
        for target in LINK.findall(markdown_of(page)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith(("#", "/")):
                continue
            relative = (page.parent / target.split("#")[0]).resolve()
            try:
                inside = relative.relative_to(docs.resolve())
            except ValueError:
                continue
            source = root / inside
            if not relative.exists() and source.is_file():
                relative.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, relative)
                copied.append(str(inside))
    return copied


def readme_sections(readme: str) -> list[tuple[str, str]]:
    """The README as (heading, text) pairs, split at its `## ` headings (not inside code
    fences); the opening comes first, with heading ""."""
    sections, heading, lines, fence = [], "", [], False
    for line in readme.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        if line.startswith("## ") and not fence:
            sections.append((heading, "\n".join(lines).strip()))
            heading, lines = line[3:].strip(), []
        lines.append(line)
    sections.append((heading, "\n".join(lines).strip()))
    return sections


HOME_SECTIONS = ["", "Quick start"]   # of the README, on the home page


def index_page(root: Path, parts: dict) -> str:
    sections = dict(readme_sections((root / "README.md").read_text(encoding="utf-8")))
    missing = [name for name in HOME_SECTIONS if name not in sections]
    if missing:
        say(f"home page: the README has no section {', '.join(map(repr, missing))}")
    readme = "\n\n".join(sections[name] for name in HOME_SECTIONS if name in sections)
    lines = [readme.strip(), "", "## The book", "", "| # | chapter | notebook |", "|---|---|---|"]
    for chapter in parts["chapters"]:
        notebook = chapter["notebook"]
        notebook_link = f"[{notebook.stem}](notebooks/{notebook.name})" if notebook else ""
        lines.append(f"| {chapter['number']} | [{chapter['title']}](chapters/{chapter['path'].name})"
                     f" | {notebook_link} |")
    for appendix in parts["appendices"]:
        lines.append(f"| | [{appendix['title']}](chapters/{appendix['path'].name}) | |")
    if parts["solutions"]:
        lines += ["", "Solutions to the exercises: "
                  + ", ".join(f"[{s['path'].stem}](chapters/solutions/{s['path'].name})"
                              for s in parts["solutions"]) + "."]
    return "\n".join(lines) + "\n"


def draw_figures(target: Path) -> None:
    """The book's figures, drawn by site/figures.py (`write_figures(out) -> list`) into target.

    Figures already under chapters/figures/ came in with the chapters; these are drawn fresh."""
    script = SITE / "figures.py"
    if not script.exists():
        say("figures: site/figures.py does not exist; no figures drawn")
        return
    spec = importlib.util.spec_from_file_location("site_figures", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # where dataclasses and pickle look a module's names up
    spec.loader.exec_module(module)
    target.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    written = module.write_figures(target)
    say(f"figures: {len(written)} drawn into chapters/figures/ in {time.perf_counter() - start:.1f} s")


def nav(parts: dict) -> list:
    entries: list = [{"Home": "index.md"}]
    for chapter in parts["chapters"]:
        pages = [{"Text": f"chapters/{chapter['path'].name}"}]
        if chapter["notebook"] is not None:
            pages.append({"Notebook": f"notebooks/{chapter['notebook'].name}"})
        entries.append({chapter["title"]: pages})
    for appendix in parts["appendices"]:
        entries.append({appendix["title"]: f"chapters/{appendix['path'].name}"})
    if parts["solutions"]:
        entries.append({"Solutions": [
            {s["title"]: f"chapters/solutions/{s['path'].name}"} for s in parts["solutions"]]})
    return entries


def assemble(work: Path, out: Path, root: Path, cache: Path, execute: bool) -> Path:
    """Write work/docs and work/mkdocs.yml; return the config's path."""
    parts = book_parts(root)
    docs = work / "docs"
    shutil.copytree(root / "chapters", docs / "chapters")
    notebooks = [c["notebook"] for c in parts["chapters"] if c["notebook"] is not None]
    executed = execute_notebooks(notebooks, cache, root) if execute else {nb: nb for nb in notebooks}
    (docs / "notebooks").mkdir()
    for notebook, source in executed.items():
        shutil.copy2(source, docs / "notebooks" / notebook.name)
    (docs / "index.md").write_text(index_page(root, parts), encoding="utf-8")
    draw_figures(docs / "chapters" / "figures")

    shutil.copytree(SITE / "javascripts", docs / "javascripts")
    extra_javascript = []
    es5 = fetch_mathjax(cache)
    if es5 is not None:
        copy_mathjax(es5, docs / "javascripts" / "mathjax")
        extra_javascript = ["javascripts/mathjax-config.js", "javascripts/mathjax/tex-chtml.js"]
        say(f"MathJax {json.loads((es5.parent / 'package.json').read_text())['version']} served from the site")

    shutil.copytree(SITE / "stylesheets", docs / "stylesheets")
    extra_css = []
    font = fetch_font(cache)
    if font is not None:
        size = copy_font(font, docs / FONT_DIR)
        extra_css.append(f"{FONT_DIR}/noto-sans-sc.css")
        say(f"{FONT_FAMILY} served from the site ({size / 1e6:.1f} MB, weight {', '.join(FONT_WEIGHTS)})")
    extra_css.append("stylesheets/extra.css")   # the font stacks, FONT_FAMILY first

    copied = copy_linked_files(docs, root)
    if copied:
        say(f"linked repository files copied in: {', '.join(sorted(copied))}")

    import yaml  # a dependency of mkdocs

    config = {
        "INHERIT": str(SITE / "mkdocs.yml"),
        "docs_dir": str(docs),
        "site_dir": str(out),
        "nav": nav(parts),
        "hooks": [str(SITE / "hooks.py")],
        "extra_javascript": extra_javascript,
        "extra_css": extra_css,
    }
    path = work / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def build(out: Path = DEFAULT_OUT, cache: Path = DEFAULT_CACHE, execute: bool = True,
          root: Path = ROOT) -> None:
    out, cache = out.resolve(), cache.resolve()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minidist-site-") as work:
        config = assemble(Path(work), out, root, cache, execute)
        result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--clean", "-f", str(config)],
                                capture_output=True, text=True)
    for line in result.stderr.splitlines():
        if line.startswith(("WARNING", "ERROR")) or result.returncode != 0:
            say(line)
    if result.returncode != 0:
        raise SystemExit(f"mkdocs build failed ({result.returncode})")
    shown = os.path.relpath(out) if out.is_relative_to(Path.cwd()) else out
    say(f"built {shown} in {time.perf_counter() - start:.0f} s; "
        f"to read it: python -m http.server -d {shown} 8000")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT,
                        help=f"where the site goes (default: {os.path.relpath(DEFAULT_OUT)})")
    parser.add_argument("--no-execute", action="store_true",
                        help="render the notebooks as committed (no outputs, no plots)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help="executed notebooks, MathJax and the font (default: %(default)s)")
    args = parser.parse_args(argv)
    build(args.out, args.cache, execute=not args.no_execute)


if __name__ == "__main__":
    main()
