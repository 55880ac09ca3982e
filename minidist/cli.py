"""The command lines' one rule: a bad value stops the program in one line, before any work (chapter 2).

Every `python -m minidist...` program builds its parser with `OneLineParser` and checks each
flag where argparse reads it, with the `type=` functions below: a bad value prints one line
on stderr (`minidist.demo: error: argument --lr: expected a finite number > 0, got 'nan'`),
from rank 0 only when the program runs under mpirun, and exits with status 2 — no
traceback, no usage block, nothing trained, no message sent. Every rank reads the same flags,
so every rank reaches the same verdict and all of them stop together.

    parser = OneLineParser(prog="python -m minidist.bench zero")
    parser.add_argument("--steps", type=integer(1), default=2)          # 1, 2, ...
    parser.add_argument("--stages", type=listof(integer(0, 3)))         # "0,1,2,3"

Checks that involve several flags (or the number of ranks) run after parsing and end with
`parser.error(...)`, which prints the same one line.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile


def _rank() -> int:
    """This process's rank in the job, without starting MPI for a program that does not use it."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank()
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (rank 0 only) and exit status 2."""

    def error(self, message):
        if _rank() == 0:
            name = self.prog.removeprefix("python -m ")
            print(f"{name}: error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def _bounds(lo, hi, lo_open=False, hi_open=False) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {hi:g}"
    return ""


def integer(lo: int | None = None, hi: int | None = None):
    """A `type=` for a whole number in lo..hi (either end may be open-ended: None)."""
    wanted = ("an integer" + (f" in {lo}..{hi}" if lo is not None and hi is not None else
                              f" >= {lo}" if lo is not None else f" <= {hi}" if hi is not None else ""))

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False):
    """A `type=` for a finite float within the bounds (open ends exclude the bound itself)."""
    wanted = "a finite number" + _bounds(lo, hi, lo_open, hi_open)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        bad = (not math.isfinite(value)
               or (lo is not None and (value <= lo if lo_open else value < lo))
               or (hi is not None and (value >= hi if hi_open else value > hi)))
        if bad:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse


def one_of(options):
    """A `type=` for one word of `options` (where a list of them is read, see `listof`)."""

    def parse(text: str) -> str:
        if text not in options:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(options)}, got {text!r}")
        return text

    return parse


def listof(item):
    """A `type=` for a comma-separated list, each entry read by `item` (another `type=`)."""

    def parse(text: str) -> list:
        entries = text.split(",")
        if not text.strip() or any(not e.strip() for e in entries):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        values = []
        for entry in entries:
            try:
                values.append(item(entry.strip()))
            except argparse.ArgumentTypeError as error:
                raise argparse.ArgumentTypeError(f"{error} in {text!r}" if len(entries) > 1 else str(error)) from None
        return values

    return parse


def _unwritable(path: str) -> str | None:
    """Why a result file cannot be written at `path`, or None if its place is fine."""
    if not path:
        return "an empty name; give a file name"
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        return "is a directory; give a file name"
    if not os.path.isdir(directory):
        return f"the directory {directory} does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"the directory {directory} is not writable"
    try:  # what the write will do (a file beside it, renamed over it): permissions are not all (/proc, root)
        with tempfile.NamedTemporaryFile(dir=directory, suffix=".tmp"):
            pass  # removed on leaving
    except OSError as error:
        return f"cannot create a file in {directory} ({error.strerror or error})"
    return None


def check_writable(flag: str, path: str) -> None:
    """A result file's place is checked before the work, not after it (nothing lost)."""
    why = _unwritable(path)
    if why:
        raise ValueError(f"{flag} {path or repr(path)}: {why}")


def output_file(text: str) -> str:
    """A `type=` for a result file (--json PATH): a name in a directory that exists and is writable."""
    why = _unwritable(text)
    if why:
        raise argparse.ArgumentTypeError(f"{text!r}: {why}")
    return text
