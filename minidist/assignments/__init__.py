"""Course assignments cut from minidist's own source (see docs/instructors.md).

    python -m minidist.assignments list
    python -m minidist.assignments build OUT [--only NAME ...]
    python -m minidist.assignments grade STUDENT_DIR [--json PATH]
    python -m minidist.assignments grade SUBMISSIONS_DIR --class [--out DIR] [--jobs N] [--seed N]
    python -m minidist.assignments grade SUBMISSION --format gradescope --out DIR
    python -m minidist.assignments gradescope OUT.zip [--only NAME ...]
"""
from minidist.assignments.registry import ASSIGNMENTS, BY_NAME, Assignment

__all__ = ["ASSIGNMENTS", "BY_NAME", "Assignment"]
