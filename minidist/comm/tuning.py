"""A tuning table for all_reduce(algorithm="auto"): the fastest algorithm, measured (chapter 7).

`auto` without a table decides from what it knows about the machine (shared memory on one node,
the hierarchy across nodes, the alpha-beta model between single ranks: `collectives.choose_all_reduce`).
A model is a guess; the machine is the truth. MPI libraries and NCCL therefore ship tuning files:
for each group size and message size, the algorithm measured fastest (MPICH reads one named by
`MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE`). minidist does the same:

    mpirun -n 2 python -m minidist.bench collectives --tune tuning.json   # measure, write the table
    export MINIDIST_TUNING=$PWD/tuning.json                                # every job after reads it

`--tune` times every all-reduce algorithm at each size and keeps the fastest; a second run with
another number of ranks adds its own table to the same file. With MINIDIST_TUNING set, `auto`
looks up the table of its group (ranks, machines) and takes the entry of the largest measured size
not above the array's (the smallest measured size below that); a group the file has no table for
falls back to the built-in choice. Every rank reads the same file (mpiexec passes the variable to
all of them): on several machines the file must be the same everywhere, or ranks would disagree.

The file, JSON:

    {"format": "minidist-all-reduce-tuning/1",
     "tables": [{"ranks": 2, "machines": 1, "mpi": "MPICH Version: 4.3.0",
                 "sizes": [{"bytes": 1024, "algorithm": "shared_memory",
                            "seconds": {"ring": 1.1e-05, "shared_memory": 4.2e-06, ...}}, ...]}]}
"""
from __future__ import annotations

import bisect
import functools
import json
import os

FORMAT = "minidist-all-reduce-tuning/1"
ENV = "MINIDIST_TUNING"


class TuningError(ValueError):
    """The file MINIDIST_TUNING names cannot be used; the message names it and says why."""


@functools.lru_cache(maxsize=1)
def table_path() -> str | None:
    """The tuning file auto reads: MINIDIST_TUNING, or None (the built-in choice). Read once per
    process, as MPI reads its settings at start: every all-reduce asks, and must cost nothing."""
    return os.environ.get(ENV) or None


@functools.lru_cache(maxsize=8)
def _read(path: str, known: tuple) -> dict:
    """{(ranks, machines): ([bytes ascending], [algorithm])}, checked (the algorithms against
    `known`, when given). Read once per process: a file that changed under a running job would
    make its ranks disagree."""
    def bad(why: str):
        return TuningError(f"{ENV}={path}: {why} (write it with `mpirun -n N python -m minidist.bench "
                           "collectives --tune PATH`, or unset the variable)")

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as error:
        raise bad(f"cannot be read ({error.strerror or error})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad(f"is not JSON ({error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("tables"), list):
        raise bad(f'is not a tuning table (expected {{"format": "{FORMAT}", "tables": [...]}})')
    tables = {}
    for i, table in enumerate(data["tables"]):
        try:
            key = (int(table["ranks"]), int(table["machines"]))
            rows = sorted((int(row["bytes"]), str(row["algorithm"])) for row in table["sizes"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"table {i} needs ranks, machines and sizes of {{bytes, algorithm}}") from None
        unknown = sorted({name for _, name in rows} - set(known)) if known else []
        if unknown or not rows:
            raise bad(f"table {i} ({key[0]} ranks) names no algorithm" if not rows else
                      f"table {i} ({key[0]} ranks) names unknown algorithms {unknown}; choose from {sorted(known)}")
        tables[key] = ([b for b, _ in rows], [a for _, a in rows])
    return tables


def load(path: str | None = None, known: tuple = ()) -> dict:
    """The tables of the file at `path` (default: MINIDIST_TUNING); {} when there is none.
    `known`: the algorithm names a table may use (collectives.ALL_REDUCE's)."""
    path = path or table_path()
    return {} if path is None else _read(path, tuple(known))


def lookup(ranks: int, machines: int, nbytes: int, path: str | None = None, known: tuple = ()) -> str | None:
    """The measured algorithm for an all-reduce of `nbytes` on `ranks` ranks over `machines`
    machines: the entry of the largest measured size <= nbytes (the smallest if nbytes is below
    all); None without a table for that group."""
    table = load(path, known).get((ranks, machines))
    if table is None:
        return None
    sizes, algorithms = table
    return algorithms[max(0, bisect.bisect_right(sizes, nbytes) - 1)]


def write(path: str, ranks: int, machines: int, rows: list[dict], mpi: str = "") -> dict:
    """Add (or replace) the table of (ranks, machines) in the file at `path`, keeping the others;
    `rows` are {"bytes", "algorithm", "seconds"}. Written whole to a temporary file, then renamed."""
    tables = []
    if os.path.exists(path):
        _read.cache_clear()
        load(path)  # an unusable file is reported, not overwritten
        with open(path, encoding="utf-8") as f:
            tables = [t for t in json.load(f)["tables"] if (t["ranks"], t["machines"]) != (ranks, machines)]
    tables.append({"ranks": ranks, "machines": machines, "mpi": mpi, "sizes": rows})
    tables.sort(key=lambda t: (t["machines"], t["ranks"]))
    data = {"format": FORMAT, "tables": tables}
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(temporary, path)
    _read.cache_clear()
    return data
