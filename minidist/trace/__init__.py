"""Traces of whole jobs, in the format Perfetto and chrome://tracing open (chapter 5: where the time goes).

    mpirun -n 2 python -m minidist.demo --pp 2 --trace run.json     # then open run.json in https://ui.perfetto.dev
    python -m minidist.trace summary run.json [--json]               # per rank: compute, exposed comm, idle, optimizer

One idea: chapter 3's per-rank timelines, for every layout and everything at once: each rank
records what it did (recorder.py: the steps, every micro-batch's and layer's forward and backward,
the optimizer, every collective with its bytes, every message as an arrow from sender to receiver,
the memory ledger after each step) on a clock aligned with rank 0's (clock.py); at the end rank 0
gathers the recordings and writes one Chrome Trace Event Format file (chrome.py), which
`summary.py` reads back as Holistic Trace Analysis' temporal breakdown does.

A program traces itself in four calls, each a no-op when no trace was begun:

    trace.begin(world)                 # collective: align the clocks, start recording
    with trace.step(i, trainer): ...   # one training step: its span, then the trainer's memory ledger
    trace.pause() / trace.resume()     # leave out what is not training (the demo's final gathers)
    trace.end(path, world)             # collective: rank 0 writes the file
"""
from __future__ import annotations

import contextlib

from minidist import timeline
from minidist.core.nn import Module
from minidist.trace import chrome, clock
from minidist.trace.recorder import Recorder, install

_job: dict = {}  # this process's recording, from begin() to end()

ROOTS = ("local_model", "stage", "module", "model")  # where a trainer keeps the model it runs
PILES = ("params", "grads", "optimizer", "activations")  # the memory ledger's four piles (chapter 1)


def begin(world, metadata: dict | None = None) -> None:
    """Start recording this job (every rank calls it: the clocks are aligned first)."""
    recorder = Recorder(world.rank)
    recorder.clock = clock.align(world.comm)
    _job.update(recorder=recorder, metadata=dict(metadata or {}), watched=set())
    install(recorder)


def pause() -> None:
    if _job:
        install(None)


def resume() -> None:
    if _job:
        install(_job["recorder"])


@contextlib.contextmanager
def step(index: int, trainer=None):
    """One training step: a span around it, its model's layers traced, then its memory ledger."""
    recorder = timeline.RECORDER
    if recorder is None:
        yield
        return
    if trainer is not None:
        watch(trainer)
    with recorder.span(f"step {index}", "step", args={"step": index, "trainer": getattr(trainer, "name", None)}):
        yield
    if callable(getattr(trainer, "memory", None)):  # PyTorch's trainer in a benchmark has no ledger
        ledger = trainer.memory()
        recorder.counter("memory", {pile: ledger.get(pile, 0) for pile in PILES})


def watch(trainer) -> None:
    """Mark the layers of the model `trainer` runs, so the engine traces them (core/nn.py): the
    model (or stage) itself, each of its parts (wte, ln_f, ...) and each block of its lists (h.0, ...)."""
    if id(trainer) in _job["watched"]:
        return
    _job["watched"].add(id(trainer))
    roots = {id(m): m for m in (getattr(trainer, name, None) for name in ROOTS) if isinstance(m, Module)}
    for root in roots.values():
        root.layer_name, root.layer_root = type(root).__name__, True
        for name, part in root.named_children():
            if type(part).forward is Module.forward:  # a list of blocks, never called itself
                for index, block in part.named_children():
                    block.layer_name = f"{name}.{index}"
            else:
                part.layer_name = name


def end(path: str | None, world) -> None:
    """Stop recording; rank 0 gathers every rank's recording and writes `path` (collective)."""
    if not _job:
        return
    install(None)
    recorder, metadata = _job["recorder"], _job["metadata"]
    _job.clear()
    ranks = world.comm.gather({**recorder.export(), "clock": recorder.clock}, root=0)
    if world.rank == 0 and path:
        chrome.write(path, chrome.to_chrome(sorted(ranks, key=lambda r: r["rank"]), metadata))
