"""Build the book as a static site: python site/build.py [OUT] [--no-execute]

mkdocs cannot use the repository root as its docs folder, so this script assembles one:

- chapters/ (the texts, the appendix, solutions/ and any figures), as they are;
- notebooks/NN_*.ipynb, executed top to bottom so that every plot is in the page (nbclient,
  with a progress bar); executed notebooks are cached under --cache, keyed by the notebook's
  bytes and the minidist sources, so an unchanged book builds in seconds;
- index.md (the README's opening and a table of the chapters);
- MathJax 3 from the npm registry (`npm install mathjax@3` into --cache), served by the site
  itself: no CDN, so the math renders offline;
- any repository file a chapter links to (e.g. ../minidist/parallel/zero.py), so the link works;

then writes a config that inherits site/mkdocs.yml, adds the nav (each chapter's notebook next
to it, then the appendix and the solutions), and runs `mkdocs build`.
"""

from __future__ import annotations

import argparse
import hashlib
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


# --- MathJax, from the npm registry ----------------------------------------------------------


def fetch_mathjax(cache: Path) -> Path | None:
    """MathJax's es5/ folder (npm install into the cache once), or None if it cannot be had."""
    es5 = cache / "npm" / "node_modules" / "mathjax" / "es5"
    if (es5 / "tex-chtml.js").exists():
        return es5
    npm = shutil.which("npm")
    if npm is None:
        say("MathJax NOT served: npm is not installed; math shows as TeX source")
        return None
    (cache / "npm").mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [npm, "install", "--silent", "--no-audit", "--no-fund", "--no-save",
         "--prefix", str(cache / "npm"), MATHJAX_PACKAGE],
        capture_output=True, text=True,
    )
    if result.returncode != 0 or not (es5 / "tex-chtml.js").exists():
        say(f"MathJax NOT served: `npm install {MATHJAX_PACKAGE}` failed; math shows as TeX source\n"
            + result.stderr.strip()[-2000:])
        return None
    return es5


def copy_mathjax(es5: Path, target: Path) -> None:
    for part in MATHJAX_PARTS:
        source = es5 / part
        if source.is_dir():
            shutil.copytree(source, target / part)
        elif source.exists():
            (target / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / part)


# --- the docs folder -------------------------------------------------------------------------

LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def copy_linked_files(docs: Path, root: Path) -> list[str]:
    """Copy into docs the repository files that its Markdown links to but it lacks."""
    copied = []
    for md in docs.rglob("*.md"):
        for target in LINK.findall(md.read_text(encoding="utf-8")):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "/")):
                continue
            relative = (md.parent / target.split("#")[0]).resolve()
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


def index_page(root: Path, parts: dict) -> str:
    readme = (root / "README.md").read_text(encoding="utf-8").split("\n## ")[0]
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

    shutil.copytree(SITE / "javascripts", docs / "javascripts")
    extra_javascript = []
    es5 = fetch_mathjax(cache)
    if es5 is not None:
        copy_mathjax(es5, docs / "javascripts" / "mathjax")
        extra_javascript = ["javascripts/mathjax-config.js", "javascripts/mathjax/tex-chtml.js"]
        say(f"MathJax {json.loads((es5.parent / 'package.json').read_text())['version']} served from the site")

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
                        help="executed notebooks and MathJax (default: %(default)s)")
    args = parser.parse_args(argv)
    build(args.out, args.cache, execute=not args.no_execute)


if __name__ == "__main__":
    main()
