"""A tuning table for all_reduce(algorithm="auto"): the fastest algorithm, measured (chapter 7).

`auto` without a table decides from what it knows about the machine (shared memory on one node,
the hierarchy across nodes, the alpha-beta model between single ranks: `collectives.choose_all_reduce`).
A model is a guess; the machine is the truth. MPI libraries and NCCL therefore ship tuning files:
for each group size and message size, the algorithm measured fastest (MPICH reads one named by
`MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE`). minidist does the same:

    mpirun -n 2 python -m minidist.bench collectives --tune tuning.json   # measure, write the table
    export MINIDIST_TUNING=$PWD/tuning.json                                # every job after reads it

`--tune` times every all-reduce algorithm at each size and keeps the fastest; a second run with
another number of ranks adds its own table to the same file. On one machine it first times the
shared-memory all-reduce's piece size (how much of a large array goes through the window per
handshake, `shared_memory.py`) and keeps the fastest as the table's `piece_bytes`, which the window
then uses: like NCCL's buffer size, the best piece depends on the machine's caches and on how
dearly a handshake is paid there, so it is measured rather than guessed.

With MINIDIST_TUNING set, `auto` looks up the table of its group (ranks, machines) and takes the
entry of the largest measured size not above the array's (the smallest measured size below that);
a group the file has no table for falls back to the built-in choice. Every rank reads the same
file (mpiexec passes the variable to all of them): on several machines the file must be the same
everywhere, or ranks would disagree.

The file, JSON:

    {"format": "minidist-all-reduce-tuning/1",
     "tables": [{"ranks": 2, "machines": 1, "mpi": "MPICH Version: 4.3.0", "piece_bytes": 1048576,
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
PIECE_RANGE = (64 << 10, 1 << 30)  # a piece the window accepts: from one small array's slot to 1 GiB


class TuningError(ValueError):
    """The file MINIDIST_TUNING names cannot be used; the message names it and says why."""


@functools.lru_cache(maxsize=1)
def table_path() -> str | None:
    """The tuning file auto reads: MINIDIST_TUNING, or None (the built-in choice). Read once per
    process, as MPI reads its settings at start: every all-reduce asks, and must cost nothing."""
    return os.environ.get(ENV) or None


@functools.lru_cache(maxsize=8)
def _read(path: str, known: tuple) -> dict:
    """{(ranks, machines): ([bytes ascending], [algorithm], piece bytes or None)}, checked (the
    algorithms against `known`, when given). Read once per process: a file that changed under a
    running job would make its ranks disagree."""
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
        piece = table.get("piece_bytes")
        if piece is not None and not (isinstance(piece, int) and not isinstance(piece, bool)
                                      and PIECE_RANGE[0] <= piece <= PIECE_RANGE[1] and piece % 64 == 0):
            raise bad(f"table {i} ({key[0]} ranks): piece_bytes must be a multiple of 64 from "
                      f"{PIECE_RANGE[0]} to {PIECE_RANGE[1]}, got {piece!r}")
        tables[key] = ([b for b, _ in rows], [a for _, a in rows], piece)
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
    sizes, algorithms, _ = table
    return algorithms[max(0, bisect.bisect_right(sizes, nbytes) - 1)]


def piece(ranks: int, machines: int = 1, path: str | None = None) -> int | None:
    """The shared-memory window's measured piece size for a group of `ranks` on `machines` (the
    table's `piece_bytes`); None without a table or a measured piece (the built-in size)."""
    table = load(path).get((ranks, machines))
    return None if table is None else table[2]


def write(path: str, ranks: int, machines: int, rows: list[dict], mpi: str = "", piece: int | None = None,
          piece_seconds: dict | None = None) -> dict:
    """Add (or replace) the table of (ranks, machines) in the file at `path`, keeping the others;
    `rows` are {"bytes", "algorithm", "seconds"}; `piece`, where measured, the shared-memory piece
    chosen, and `piece_seconds` what each piece took. Written whole to a temporary file, then renamed."""
    tables = []
    if os.path.exists(path):
        _read.cache_clear()
        load(path)  # an unusable file is reported, not overwritten
        with open(path, encoding="utf-8") as f:
            tables = [t for t in json.load(f)["tables"] if (t["ranks"], t["machines"]) != (ranks, machines)]
    table = {"ranks": ranks, "machines": machines, "mpi": mpi, "sizes": rows}
    if piece:
        table.update(piece_bytes=piece, piece_seconds=piece_seconds or {})
    tables.append(table)
    tables.sort(key=lambda t: (t["machines"], t["ranks"]))
    data = {"format": FORMAT, "tables": tables}
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(temporary, path)
    _read.cache_clear()
    return data
