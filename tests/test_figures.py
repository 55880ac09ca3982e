"""The book's figures (site/figures.py, drawn by site/book_figures/): each is written, is valid SVG, belongs under a heading its
chapter really has, and comes out byte for byte the same when drawn again.

The quick tier checks the manifest and draws a few figures; the extended tier draws every one here
(about ten seconds of CPU), as the site build in the full tier does (tests/test_site.py)."""
import importlib.util
import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
SVG = "{http://www.w3.org/2000/svg}svg"
SAMPLE = ["ch05_gpipe_and_1f1b", "ch07_ring_steps", "ch10_loss_scale"]  # a Gantt chart, a table, a line chart


@pytest.fixture(scope="module")
def figures():
    """site/figures.py, loaded as site/build.py loads it: from its path."""
    spec = importlib.util.spec_from_file_location("site_figures", ROOT / "site" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def headings(path: Path) -> list[str]:
    """The Markdown heading lines of a chapter, leaving out lines inside fenced code blocks."""
    found, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append(line.rstrip())
    return found


def check_svg(path: Path) -> None:
    root = ET.parse(path).getroot()  # raises on anything that is not well-formed XML
    assert root.tag == SVG, f"{path.name}: root element {root.tag}"
    assert float(root.get("width").removesuffix("pt")) > 0 and float(root.get("height").removesuffix("pt")) > 0
    assert len(list(root.iter())) > 50, f"{path.name}: an almost empty drawing"


def test_every_figure_sits_under_a_heading_of_its_chapter(figures):
    names = [f.name for f in figures.FIGURES]
    assert len(names) == len(set(names)), [n for n, c in Counter(names).items() if c > 1]
    for fig in figures.FIGURES:
        assert re.fullmatch(r"[a-z0-9_]+", fig.name), fig.name
        chapter = CHAPTERS / fig.chapter
        assert chapter.is_file(), f"{fig.name}: no chapter {fig.chapter}"
        count = headings(chapter).count(fig.after)
        assert count == 1, f"{fig.name}: heading {fig.after!r} found {count} times in {fig.chapter}"


def test_captions_and_alt_texts(figures):
    for fig in figures.FIGURES:
        assert fig.caption.strip() and fig.caption.endswith("."), f"{fig.name}: caption {fig.caption!r}"
        assert len(fig.alt) >= 80, f"{fig.name}: the alt text should describe the picture, got {fig.alt!r}"
        assert fig.alt != fig.caption
        assert f"figures/{fig.name}.svg" in figures.markdown(fig)


def test_at_least_three_figures_per_chapter(figures):
    chapters = sorted(p.name for p in CHAPTERS.glob("[0-9][0-9]_*.md"))
    assert len(chapters) == 11, chapters
    per_chapter = Counter(f.chapter for f in figures.FIGURES)
    assert {c: per_chapter[c] for c in chapters if per_chapter[c] < 3} == {}
    assert set(per_chapter) <= set(chapters)


def test_a_few_figures_are_valid_svg_and_deterministic(figures, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    written = figures.write_figures(first, SAMPLE, progress=False)
    figures.write_figures(second, SAMPLE, progress=False)
    assert [f.name for f in written] == SAMPLE
    for name in SAMPLE:
        check_svg(first / f"{name}.svg")
        assert (first / f"{name}.svg").read_bytes() == (second / f"{name}.svg").read_bytes(), name


def test_unknown_names_and_the_manifest(figures, tmp_path, capsys):
    with pytest.raises(ValueError, match="no figure named nonsense"):
        figures.write_figures(tmp_path / "out", ["nonsense"], progress=False)
    assert not (tmp_path / "out").exists()  # refused before anything is written
    assert figures.main(["--list"]) == 0
    table = capsys.readouterr().out
    assert all(f"| {f.name} | {f.chapter} |" in table for f in figures.FIGURES)


@pytest.mark.extended  # the site build (tests/test_site.py) draws every figure and checks each loads
def test_every_figure_is_written_as_valid_svg(figures, tmp_path):
    written = figures.write_figures(tmp_path, progress=False)
    assert [f.name for f in written] == [f.name for f in figures.FIGURES]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{f.name}.svg" for f in figures.FIGURES)
    for fig in written:
        check_svg(tmp_path / f"{fig.name}.svg")
