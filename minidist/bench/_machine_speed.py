"""How fast this shared machine is at one moment, measured beside each of `bench plan`'s runs (chapter 9).

The planner is calibrated once, from yardsticks measured before and after the layouts; a layout
that runs while a neighbour takes part of the machine runs slower than any model of minidist can
say. `SpeedProbe` measures the machine at one moment: one worker process per core, each holding a
small serial training step of the demo GPT (`bench.step.minidist_step`), all stepping at once, the
way a job's ranks fill every core. `bench plan` probes before each yardstick and before and after
each layout's run; the mean of the two around a run over the probes' median while the yardsticks
were measured is the machine's slowdown during that run (`slowdown`), and the prediction for the
machine as it was then is the prediction times that slowdown.
"""
from __future__ import annotations

import multiprocessing
import time

PROBE_STEPS = 5  # steps per worker and probe; its fastest is kept (fewer: the probe's own noise shows)


def _worker(config, batch: int, pipe) -> None:
    """A probe's worker: one serial step built once, then the fastest of `PROBE_STEPS` steps per request."""
    from threadpoolctl import threadpool_limits

    from minidist.bench.step import minidist_step

    with threadpool_limits(1):  # a rank's share: one BLAS thread, as the demo's ranks run
        step = minidist_step(config, batch, "float32")[0]
        step()  # the first step allocates what the others reuse
        pipe.send("ready")
        while pipe.recv():
            times = []
            for _ in range(PROBE_STEPS):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            pipe.send(min(times))


class SpeedProbe:
    """`workers` processes, each stepping a serial model of `batch` sequences; `seconds()` is the mean of
    their fastest steps when they all step at once. Use as a context manager: the workers end with it."""

    def __init__(self, config, batch: int, workers: int):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of the caller's state shared
        self.pipes, self.processes = [], []
        for _ in range(workers):
            parent, child = context.Pipe()
            process = context.Process(target=_worker, args=(config, batch, child), daemon=True)
            process.start()
            self.pipes.append(parent)
            self.processes.append(process)
        for pipe in self.pipes:
            if pipe.recv() != "ready":
                raise RuntimeError("the machine-speed probe's worker did not start")

    def seconds(self) -> float:
        for pipe in self.pipes:
            pipe.send(True)
        return sum(pipe.recv() for pipe in self.pipes) / len(self.pipes)

    def close(self) -> None:
        for pipe, process in zip(self.pipes, self.processes):
            try:
                pipe.send(False)
            except OSError:
                pass
            process.join(timeout=10)
            if process.is_alive():
                process.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def slowdown(before: float, after: float, calibrated: float) -> float:
    """The machine's slowdown during a run probed `before` and `after` it: the mean of the two over
    `calibrated`, the probe's median while the yardsticks were measured (1 = as fast as then)."""
    if calibrated <= 0:
        raise ValueError(f"the probe's time while the yardsticks were measured must be positive, got {calibrated}")
    return (before + after) / 2 / calibrated
