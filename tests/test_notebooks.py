"""Every notebook runs top to bottom (the full tier; chapter notebooks assert the numbers their
chapters state, so a notebook that runs is a chapter that holds).

They are executed as the site builds them (site/build.py's `execute_notebooks`, each cell under its
time limit, in the notebook's folder) into the builder's cache, build/site-cache/: the site's own
test (tests/test_site.py) then finds them executed instead of running them a second time. One
notebook alone, outside the suite: `pytest --nbmake notebooks/05_pipeline_parallelism.ipynb`.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def load_builder():
    spec = importlib.util.spec_from_file_location("site_build", ROOT / "site" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_chapter_has_its_notebook():
    assert [nb.stem[:2] for nb in NOTEBOOKS] == [f"{i:02d}" for i in range(1, 12)]


@pytest.mark.full
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda nb: nb.stem)
def test_the_notebook_runs_top_to_bottom(notebook):
    builder = load_builder()
    try:
        executed = builder.execute_notebooks([notebook], builder.DEFAULT_CACHE, ROOT)
    except SystemExit as failure:  # the builder's one-line verdict: which notebook, which error
        pytest.fail(str(failure), pytrace=False)
    assert executed[notebook].exists()
