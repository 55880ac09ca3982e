"""`python -m minidist.bench NAME [options]`: run one benchmark.

Every benchmark prints its measurements as ratios against a yardstick measured in the same
run (these machines are shared and noisy), and can write a JSON list of records with --json.
Each benchmark is a module `minidist.bench.NAME` with a `main(argv)` function.
"""
import importlib
import pkgutil
import sys

import minidist.bench as package


def available():
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("benchmarks:", ", ".join(names))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"minidist.bench: unknown benchmark {name!r}; choose from {', '.join(names)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"minidist.bench.{name}")
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
