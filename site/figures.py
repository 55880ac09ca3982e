"""Draw the book's figures from minidist's own code: python site/figures.py [OUT] [--only NAME ...] [--list]

The drawings are in site/book_figures/ (one module per chapter); this script and the site
builder (site/build.py) load them from there."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from book_figures import FIGURES, Figure, main, manifest, markdown, write_figure, write_figures  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
