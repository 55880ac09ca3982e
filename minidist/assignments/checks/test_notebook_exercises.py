"""Graded checks of the notebooks' exercise cells: the cell that holds an assignment's region is
run on its own (its code defines the function the exercise asks for), then the function is checked
against the rule it must follow, on more cases than the notebook's own check tries."""
import json
from pathlib import Path

import pytest

from minidist.parallel.mesh import rank_of

NOTEBOOKS = Path(__file__).resolve().parents[3] / "notebooks"


def exercise(notebook: str, function: str) -> dict:
    """Run the code cell of `notebook` that defines `function` (an exercise cell holds only the
    definition; the notebook's own check is the next cell); its namespace."""
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if c["cell_type"] == "code"
                  and f"def {function}(" in "".join(c["source"]))
    namespace: dict = {}
    exec(compile(source, f"{notebook}:{function}", "exec"), namespace)  # the student's cell (sandboxed when graded)
    return namespace


@pytest.mark.parametrize("pp, dp, tp", [(2, 3, 2), (1, 1, 1), (4, 1, 2), (3, 5, 1), (1, 2, 4)])
def test_my_coordinates_inverts_rank_of(pp, dp, tp):
    """Notebook 09's exercise (mesh_groups): the coordinates of every rank of a pp x dp x tp mesh,
    each in range, mapped back to the rank by `rank_of`."""
    my_coordinates = exercise("09_frameworks.ipynb", "my_coordinates")["my_coordinates"]
    for rank in range(pp * dp * tp):
        p, d, t = my_coordinates(rank, dp, tp)
        assert 0 <= p < pp and 0 <= d < dp and 0 <= t < tp, (rank, (p, d, t))
        assert rank_of(p, d, t, dp_size=dp, tp_size=tp) == rank
